"""A GGUF file's header bounded by the file, before anything reads it: a hostile or damaged
file fails fast with a ValueError naming the field, never a traceback, a hang or a growing heap
(the sizes of the model it describes: model_sizes.py).

``check_file`` walks the header itself, before ``gguf.GGUFReader`` does: that reader trusts
every count (an array of 2**62 entries loops for ever, growing its list of parts; a file cut
short ends in an IndexError) and costs ~33 us and ~1.5 KB an array entry (a vocabulary of 3M
pieces: minutes and GBs; this walk: ~27 ms for SmolLM2's 49,152 pieces and 48,900 merges,
where the reader takes 3 s). Every length and count is bounded by the bytes left in the file,
arrays by ``MAX_ARRAY_LEN``, names by ``MAX_NAME_BYTES``; every tensor must lie inside the
file; the vocabulary may not have more pieces than ``token_embd.weight`` has rows.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# 4x the largest vocabulary served today (Gemma 3: 262,144 pieces; Llama 3: 280,147 merges).
MAX_ARRAY_LEN = 1 << 20
MAX_NAME_BYTES = 1 << 16  # a metadata key or a tensor name
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# BPE merges per row of the embedding (Llama 3: 2.2, its merges hold redundant pairs).
MAX_MERGES_PER_TOKEN = 4
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_SUPPORTED_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9  # GGUFValueType
_SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


def check_file(path: Path) -> None:
    """ValueError naming the field (not the file: the caller does) unless the file's header
    is within its bounds."""
    size = path.stat().st_size
    if size < _HEADER_BYTES:
        raise ValueError(f"{size} bytes, fewer than a GGUF header's {_HEADER_BYTES}")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _HeaderScan(data).run()


class _HeaderScan:
    """One pass over the header: metadata, then tensor infos; nothing is kept but counts."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.offset = 0
        self.order = "<"

    def error(self, message: str) -> ValueError:
        return ValueError(message)

    @property
    def num_left(self) -> int:
        return len(self.data) - self.offset

    def read(self, fmt: str, what: str) -> int | float:
        size = struct.calcsize(fmt)
        if size > self.num_left:
            raise self.error(f"{what} is cut off at byte {self.offset}: the file is truncated")
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += size
        return value

    def check_count(self, what: str, count: int, item_bytes: int, most: int) -> None:
        """``count`` items of at least ``item_bytes`` each must fit in what is left."""
        if count > most:
            raise self.error(f"{what} is {count}, more than {most}")
        if count * item_bytes > self.num_left:
            raise self.error(
                f"{what} is {count}, more than the {self.num_left} bytes left in the file hold"
            )

    def name_text(self, what: str) -> str:
        length = self.read("Q", f"the length of {what}")
        self.check_count(f"the length of {what}", length, 1, MAX_NAME_BYTES)
        raw = self.data[self.offset : self.offset + length]
        self.offset += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not UTF-8: {raw[:64]!r}") from None

    def skip_strings(self, key: str, count: int) -> None:
        data, order, offset, end = self.data, self.order + "Q", self.offset, len(self.data)
        for i in range(count):  # the hot loop of a vocabulary: locals only
            if offset + 8 > end:
                self.offset = offset
                raise self.error(f"{key}[{i}] is cut off: the file is truncated")
            (length,) = struct.unpack_from(order, data, offset)
            offset += 8 + length
            if offset > end:
                raise self.error(f"{key}[{i}] has a length of {length}, past the end of the file")
        self.offset = offset

    def run(self) -> None:
        if self.data[:4] != b"GGUF":
            raise self.error("not a GGUF file (it does not start with 'GGUF')")
        self.offset = 4
        version = self.read("I", "the version")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.order = ">"
            version = struct.unpack_from(">I", self.data, 4)[0]
        if version not in _SUPPORTED_VERSIONS:
            raise self.error(f"GGUF version {version} is not supported (only 2 and 3)")
        num_tensors = self.read("Q", "GGUF.tensor_count")
        num_keys = self.read("Q", "GGUF.kv_count")
        # a key's length (8 bytes), its type (4) and a value (1) at least
        self.check_count("GGUF.kv_count", num_keys, 13, MAX_ARRAY_LEN)
        arrays, alignment = self.metadata(num_keys)
        # a name's length (8 bytes), one dimension (4 + 8), a type (4), an offset (8) at least
        self.check_count("GGUF.tensor_count", num_tensors, 32, MAX_ARRAY_LEN)
        tensors = self.tensor_infos(num_tensors)
        self.offset += -self.offset % alignment
        self.check_tensor_data(tensors)
        self.check_vocabulary(arrays, tensors)

    def metadata(self, num_keys: int) -> tuple[dict[str, int], int]:
        """-> (array key -> its length, general.alignment)."""
        keys: set[str] = set()
        arrays: dict[str, int] = {}
        alignment = 32
        for i in range(num_keys):
            key = self.name_text(f"metadata key #{i}")
            if key in keys:
                raise self.error(f"metadata key {key!r} appears twice")
            keys.add(key)
            kind = self.read("I", f"the type of {key}")
            if kind == _ARRAY:
                item_kind = self.read("I", f"the item type of {key}")
                count = self.read("Q", f"the length of {key}")
                if item_kind == _STRING:
                    self.check_count(f"the length of {key}", count, 8, MAX_ARRAY_LEN)
                    self.skip_strings(key, count)
                elif item_kind in _SCALAR_FORMATS:
                    item_bytes = struct.calcsize(_SCALAR_FORMATS[item_kind])
                    self.check_count(f"the length of {key}", count, item_bytes, MAX_ARRAY_LEN)
                    self.offset += count * item_bytes
                else:
                    raise self.error(f"{key} is an array of an unsupported type ({item_kind})")
                arrays[key] = count
            elif kind == _STRING:
                length = self.read("Q", f"the length of {key}")
                self.check_count(f"the length of {key}", length, 1, self.num_left)
                self.offset += length
            elif kind in _SCALAR_FORMATS:
                value = self.read(_SCALAR_FORMATS[kind], key)
                if key == "general.alignment":
                    if kind != 4 or value < 1 or value & (value - 1):
                        raise self.error(f"general.alignment must be a power of two (got {value})")
                    alignment = value
            else:
                raise self.error(f"{key} has an unknown value type ({kind})")
        return arrays, alignment

    def tensor_infos(self, num_tensors: int) -> dict[str, tuple[list[int], int, int]]:
        """-> name -> (dimensions, innermost first; data offset; size in bytes)."""
        tensors: dict[str, tuple[list[int], int, int]] = {}
        for i in range(num_tensors):
            name = self.name_text(f"tensor name #{i}")
            if name in tensors:
                raise self.error(f"tensor {name!r} appears twice")
            num_dims = self.read("I", f"the number of dimensions of {name}")
            if not 1 <= num_dims <= MAX_DIMS:
                raise self.error(f"tensor {name!r} has {num_dims} dimensions (1 to {MAX_DIMS})")
            dims = [self.read("Q", f"a dimension of {name}") for _ in range(num_dims)]
            kind = self.read("I", f"the type of {name}")
            offset = self.read("Q", f"the data offset of {name}")
            try:
                block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise self.error(f"tensor {name!r} has an unknown GGML type ({kind})") from None
            if dims[0] % block_size:
                raise self.error(
                    f"tensor {name!r}: its rows of {dims[0]} are not whole blocks of {block_size}"
                )
            num_elements = 1
            for dim in dims:
                num_elements *= dim
            tensors[name] = (dims, offset, num_elements // block_size * block_bytes)
        return tensors

    def check_tensor_data(self, tensors: dict[str, tuple[list[int], int, int]]) -> None:
        data_bytes = max(self.num_left, 0)
        for name, (dims, offset, num_bytes) in tensors.items():
            if offset + num_bytes > data_bytes:
                raise self.error(
                    f"tensor {name!r} (dimensions {dims}, {num_bytes} bytes at offset {offset}) "
                    f"ends past the file's {data_bytes} bytes of tensor data: the file is "
                    "truncated or the shape is wrong"
                )

    def check_vocabulary(
        self, arrays: dict[str, int], tensors: dict[str, tuple[list[int], int, int]]
    ) -> None:
        embedding = tensors.get("token_embd.weight")
        if embedding is None or len(embedding[0]) < 2:
            return  # no model to bound it by (check_counts refuses such a file for serving)
        num_rows = embedding[0][1]
        for key in _VOCAB_ARRAYS:
            if arrays.get(key, 0) > num_rows:
                raise self.error(
                    f"{key} has {arrays[key]} entries, more than the {num_rows} rows of "
                    "token_embd.weight"
                )
        num_merges = arrays.get("tokenizer.ggml.merges", 0)
        if num_merges > MAX_MERGES_PER_TOKEN * num_rows:
            raise self.error(
                f"tokenizer.ggml.merges has {num_merges} entries, more than "
                f"{MAX_MERGES_PER_TOKEN} for each of the {num_rows} rows of token_embd.weight"
            )
