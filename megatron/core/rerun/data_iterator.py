"""The rerun state machine's data iterator: an iteration's microbatches, served again."""

from __future__ import annotations

from typing import Any, Iterable


class RerunDataIterator:
    """A data iterator that can serve an iteration's microbatches again: everything read since
    ``advance()`` is kept and ``rewind()`` replays it. The rerun state machine calls both; a
    disabled machine calls ``advance(keep=False)``, and nothing is kept."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable
        self.saved_microbatches: list[Any] = []
        self.replaying = False
        self.replay_pos = 0
        self.keeping = False

    def __iter__(self) -> "RerunDataIterator":
        return self

    def __next__(self) -> Any:
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError("the re-run reads more microbatches than the first run did")
            item = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return item
        item = next(self.iterable)
        if self.keeping:
            self.saved_microbatches.append(item)
        return item

    def rewind(self) -> None:
        self.replaying, self.replay_pos = True, 0

    def advance(self, keep: bool = True) -> None:
        """A new iteration: forget the last one's microbatches; keep this one's if ``keep``."""
        self.replaying, self.saved_microbatches, self.keeping = False, [], keep

    def state_dict(self) -> dict[str, Any]:
        return {"saved_microbatches": self.saved_microbatches, "replaying": self.replaying,
                "replay_pos": self.replay_pos}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved_microbatches = state_dict["saved_microbatches"]
        self.replaying = state_dict["replaying"]
        self.replay_pos = state_dict["replay_pos"]
