"""LoRABudget: the distinct LoRA adapters of the running requests, against ``max_loras``.

The model runner has ``max_loras`` device slots (pydaemon/worker/lora_manager.py), and every
running request decodes in every step, so the running requests may use at most that many
distinct adapters. A waiting (or swapped) request whose adapter would be one too many waits;
requests behind it whose adapter is running (or who use none) may go first.
"""

from __future__ import annotations

from pydaemon.core.request import Request


class LoRABudget:
    def __init__(self, max_loras: int | None) -> None:
        """``max_loras`` None: LoRA is off (a request never has an adapter)."""
        self.max_loras = max_loras

    def fits(self, request: Request, running: list[Request]) -> bool:
        """Whether ``request`` may run beside ``running`` (O(len(running)) with LoRA on)."""
        lora = request.lora_request
        if lora is None:
            return True
        if self.max_loras is None:
            return False
        lora_ids = {r.lora_request.lora_int_id for r in running if r.lora_request}
        return lora.lora_int_id in lora_ids or len(lora_ids) < self.max_loras

    def first_fitting(self, waiting: list[Request], running: list[Request]) -> Request | None:
        """The first of ``waiting`` that fits beside ``running`` (O(1) when LoRA is off)."""
        if self.max_loras is None:
            return waiting[0] if waiting else None
        return next((r for r in waiting if self.fits(r, running)), None)

    @staticmethod
    def count_by_adapter(
        running: list[Request], waiting: list[Request]
    ) -> dict[str, tuple[int, int]]:
        """Adapter name -> (running, waiting) requests (swapped ones count as waiting)."""
        counts: dict[str, list[int]] = {}
        for column, requests in ((0, running), (1, waiting)):
            for request in requests:
                if request.lora_request is not None:
                    name = request.lora_request.lora_name
                    counts.setdefault(name, [0, 0])[column] += 1
        return {name: (r, w) for name, (r, w) in counts.items()}
