"""Calls to an address a config names (train.rollout.url): a redirect is never followed, so a call
reaches only the host and port the trust policy checked (grpo_core.rewards.trust), and what an
error quotes of an answer is a bounded, printable excerpt of that address's own answer. JAX-free:
the readiness probe calls it too."""

from __future__ import annotations

import urllib.error
import urllib.request

from grpo_core.errors import excerpt


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # urllib raises the 3xx as an HTTPError instead: nothing is asked of `newurl`


_OPENER = urllib.request.build_opener(_NoRedirect)


def open_url(request: urllib.request.Request | str, timeout: float):
    """urllib.request.urlopen without redirects: a 3xx answer raises urllib.error.HTTPError."""
    return _OPENER.open(request, timeout=timeout)


def redirect_of(exc: urllib.error.HTTPError) -> str | None:
    """Where a 3xx answer pointed (its Location, quoted and bounded; never fetched), or None for
    another answer."""
    if not 300 <= exc.code < 400:
        return None
    location = exc.headers.get("Location") if exc.headers is not None else None
    return excerpt(location, 200) if location else "nowhere (no Location header)"


def answer_excerpt(exc: urllib.error.HTTPError, limit: int = 200) -> str:
    """At most `limit` printable characters of an error answer's body (read no further)."""
    try:
        raw = exc.read(limit * 4) or b""
    except (OSError, ValueError):
        raw = b""
    return excerpt(raw.decode(errors="replace"), limit)
