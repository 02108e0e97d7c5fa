#!/usr/bin/env bash
# Ray for a GPU machine that cannot reach a package index: downloads Ray's cp312 manylinux
# wheel and the wheels of its dependencies into .whl/ (git-ignored), the Ray wheel (79 MB)
# split in two parts of at most 40 MB, so that each fits a carry of 64 MiB:
#   .whl/ray-1/   ray.whl.part-aa + the dependencies' wheels (~3.5 MB)
#   .whl/ray-2/   ray.whl.part-ab
# On the machine, after both folders are there:
#   cat .whl/ray-1/ray.whl.part-* .whl/ray-2/ray.whl.part-* > /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
#   python -m pip install --no-index --find-links .whl/ray-1 --find-links /tmp ray==2.60.0
# (pip installs only the dependencies the machine lacks.)
#   RAY_VERSION, PY_VERSION   override 2.60.0, 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_VERSION=${RAY_VERSION:-2.60.0}
PY_VERSION=${PY_VERSION:-3.12}
PY=${PY:-.venv/bin/python}
tag="cp${PY_VERSION/./}"
rm -rf .whl/ray-1 .whl/ray-2 && mkdir -p .whl/ray-1 .whl/ray-2
"$PY" -m pip download -q "ray==$RAY_VERSION" -d .whl/ray-1 --python-version "$PY_VERSION" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --only-binary=:all:
wheel=.whl/ray-1/ray-$RAY_VERSION-$tag-$tag-manylinux2014_x86_64.whl
(cd .whl/ray-1 && split -b 40M "$(basename "$wheel")" ray.whl.part-)
rm "$wheel"
mv .whl/ray-1/ray.whl.part-ab .whl/ray-2/
test ! -e .whl/ray-1/ray.whl.part-ac || { echo "the wheel needs more than two parts" >&2; exit 1; }
du -sh .whl/ray-1 .whl/ray-2
ls .whl/ray-1 .whl/ray-2
