"""Runs inside vLLM's worker (`--worker-extension-cls`): swaps a checkpoint's weights into the
running engine, so an RL step loads its new policy in ~1 s instead of restarting vLLM (~60 s
on this CPU). Called through vLLM's `/collective_rpc` (`Engine.load` in the pipeline)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


class WeightReload:
    if TYPE_CHECKING:
        # vLLM mixes this class into its GPU/CPU worker, which provides these (vLLM is not a
        # dependency of pi-env, so they are declared here for the checker only).
        model_runner: Any

        def reload_weights(self, *, weights_path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None:
        self.reload_weights(weights_path=path)
        # vLLM's in-place reload re-packs every layer whose weights it loaded for the CPU GEMM
        # kernels, but a tied LM head loads none of its own (its weight is the embedding's) and
        # kept the packed copy of the old embedding: pack it again from the reloaded weight.
        # Without this, the engine samples from the old head (checked in the engine tier).
        head = getattr(self.model_runner.model, "lm_head", None)
        if head is not None and getattr(head, "quant_method", None) is not None:
            head.quant_method.process_weights_after_loading(head)
