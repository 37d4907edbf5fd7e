"""A speculating chunk as the model runner reads it: the request's tokens with the drafts after them.

The runner packs a chunk's tokens `[start, end)` from its request's prompt and output. The drafts of a
speculating chunk are not output yet (they become output only once verified), so the runner is handed a
read-only view of the request whose output ends with them; everything else reads through to the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.engine.scheduler import ScheduledChunk


class _WithDrafts:
    """`request` with `drafts` appended to its output (read-only; other attributes read through)."""

    __slots__ = ("_request", "output_token_ids")

    def __init__(self, request: Any, drafts: tuple[int, ...]) -> None:
        self._request = request
        self.output_token_ids = list(request.output_token_ids) + list(drafts)

    @property
    def num_tokens(self) -> int:
        return int(self._request.num_prompt_tokens) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return list(self._request.prompt_token_ids) + self.output_token_ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def with_drafts(chunk: ScheduledChunk) -> ScheduledChunk:
    """The chunk itself, or for a speculating chunk the same chunk over a view with its drafts."""
    if not chunk.draft_token_ids:
        return chunk
    return chunk._replace(request=_WithDrafts(chunk.request, chunk.draft_token_ids))  # type: ignore[arg-type]  # a view
