"""The mailbox's bounded memory of retired tags (see :meth:`Mailbox.retire`): exact tags and
tag prefixes declared finished, so that later arrivals for them are dropped instead of queued.
Oldest forgotten first once a cap is reached. Pure, no asyncio."""

from __future__ import annotations

from collections import OrderedDict

MAX_RETIRED_PREFIXES = 256


def _remember(seen: OrderedDict[str, None], tag: str, cap: int) -> None:
    seen[tag] = None
    seen.move_to_end(tag)
    while len(seen) > cap:
        seen.popitem(last=False)


class RetiredTags:
    """Retired exact tags (at most ``max_exact``) and prefixes (at most
    :data:`MAX_RETIRED_PREFIXES`)."""

    def __init__(self, max_exact: int) -> None:
        self._max_exact = max_exact
        self._exact: OrderedDict[str, None] = OrderedDict()
        self._prefixes: OrderedDict[str, None] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._exact or self._prefixes)

    def add(self, tag: str, *, exact: bool) -> None:
        """Remember ``tag`` as retired, exactly or as a prefix of every tag it starts."""
        if exact:
            _remember(self._exact, tag, self._max_exact)
        else:
            _remember(self._prefixes, tag, MAX_RETIRED_PREFIXES)

    def forget(self, tag: str) -> None:
        """Forget ``tag`` (exact or prefix)."""
        self._exact.pop(tag, None)
        self._prefixes.pop(tag, None)

    def covers(self, tag: str) -> bool:
        """``tag`` was retired, exactly or by a retired prefix."""
        return tag in self._exact or any(tag.startswith(p) for p in self._prefixes)
