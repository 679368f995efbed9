"""The worker extension of an engine on Ray (``worker_extension_cls``, imported by module path in
each of vLLM's workers, which may be processes of their own): the weight sync's side in the
worker, driven by ``collective_rpc`` from the engine's actor, as OpenRLHF's ``WorkerWrap`` and
TRL's ``WeightSyncWorkerExtension`` are.

- ``strategy_join``: join the sync's process group (``weight_stream.weight_group``) at rank
  ``first + the worker's rank``, the store on the streaming training rank's node.
- ``strategy_receive``: read one sync's stream from that group straight into vLLM's in-place
  reload (``reload_weights``: on vLLM's CPU build ``load_weights`` alone leaves its repacked
  linear layers stale), draining it where the reload fails part way.
"""

from __future__ import annotations

from typing import Any

from strategy.rollout.weight_stream import WeightStream, weight_group


class WeightSyncExtension:
    """Mixed into vLLM's worker class by vLLM itself (its methods beside the worker's)."""

    def strategy_join(self, host: str, port: int, first: int, size: int,
                      seconds: float) -> int:
        """Join the sync's group of ``size`` as rank ``first + this worker's rank``.

        Returns:
            The rank taken.
        """
        rank = first + int(getattr(self, "rank", 0))
        self._strategy_weights: Any = weight_group(port, rank, size, seconds, host=host)
        return rank

    def strategy_receive(self) -> None:
        """One sync: every tensor streamed, into the engine's weights."""
        stream = WeightStream(self._strategy_weights)
        try:
            self.reload_weights(weights_iterator=iter(stream))  # the worker's own method
        finally:
            stream.drain()
