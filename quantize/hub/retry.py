"""Retries for every Hub call: 429 and 5xx answers (and, for GET / HEAD, dropped connections)
are retried with bounded exponential backoff that honours ``Retry-After`` (docs/faults.md).

huggingface_hub sends every request through one shared ``httpx2.Client`` made by the factory
given to ``huggingface_hub.set_client_factory``; :func:`install` gives it a client whose
transport retries, with huggingface_hub's own request hook and ``Retry-After`` parser
(``huggingface_hub.utils._http``). Bodies that cannot be sent twice (a streamed file) are not
retried here; huggingface_hub's LFS upload retries those itself (``http_backoff``).
"""

import logging
import threading
import time

__all__ = ["RETRY_STATUS", "MAX_RETRIES", "BASE_WAIT", "MAX_WAIT", "MAX_RETRY_AFTER",
           "RetryTransport", "install", "waits"]

log = logging.getLogger("spark_quant.hub")

RETRY_STATUS = (429, 500, 502, 503, 504)
MAX_RETRIES = 5
"""Retries after the first attempt; then the last answer goes to the caller (an error)."""
BASE_WAIT = 1.0
MAX_WAIT = 8.0
"""Seconds before retry n (0-based) without ``Retry-After``: min(MAX_WAIT, BASE_WAIT * 2^n)."""
MAX_RETRY_AFTER = 60.0
"""Longest ``Retry-After`` honoured (seconds); a longer one is waited this long."""
_INSTALLED = threading.Lock()
_installed = False


def waits(retry_after: list[float | None]) -> list[float]:
    """Seconds waited before each retry, given each failed answer's ``Retry-After`` (None when
    absent): the header, capped at :data:`MAX_RETRY_AFTER`, else the exponential backoff."""
    return [min(float(r), MAX_RETRY_AFTER) if r is not None else min(MAX_WAIT, BASE_WAIT * 2 ** n)
            for n, r in enumerate(retry_after)]


def _transport_base():
    import httpx2

    return httpx2.BaseTransport


class RetryTransport(_transport_base()):
    """An ``httpx2`` transport that retries :data:`RETRY_STATUS` answers up to
    :data:`MAX_RETRIES` times (``sleep(seconds)`` between tries, :func:`waits`) and logs a
    warning for each retry and when it gives up."""

    def __init__(self, inner=None, sleep=time.sleep, max_retries: int = MAX_RETRIES):
        import httpx2

        self.inner = inner or httpx2.HTTPTransport()
        self.sleep, self.max_retries = sleep, max_retries

    def handle_request(self, request):
        import httpx2
        from huggingface_hub.utils._http import _parse_retry_after

        replayable = isinstance(request.stream, httpx2.ByteStream)
        idempotent = request.method in ("GET", "HEAD")
        seen: list[float | None] = []
        while True:
            try:
                response = self.inner.handle_request(request)
            except httpx2.TransportError as e:
                if not idempotent or len(seen) >= self.max_retries:
                    if seen:
                        log.warning("Hub: giving up on %s %s after %d retries (%s)",
                                    request.method, request.url.path, len(seen), e)
                    raise
                seen.append(None)
                why = str(e) or type(e).__name__
            else:
                if response.status_code not in RETRY_STATUS or not replayable:
                    return response
                if len(seen) >= self.max_retries:
                    log.warning("Hub: giving up on %s %s after %d retries (HTTP %d)",
                                request.method, request.url.path, len(seen), response.status_code)
                    return response
                response.read()
                seen.append(_parse_retry_after(response.headers))
                why = f"HTTP {response.status_code}"
                response.close()
            wait = waits(seen)[-1]
            log.warning("Hub: %s %s: %s; retry %d/%d in %gs", request.method, request.url.path,
                        why, len(seen), self.max_retries, wait)
            self.sleep(wait)

    def close(self) -> None:
        self.inner.close()


def install(sleep=time.sleep) -> None:
    """Make huggingface_hub's shared client retry (idempotent; ``sleep`` only for tests)."""
    global _installed
    import httpx2
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import hf_request_event_hook

    with _INSTALLED:
        if _installed and sleep is time.sleep:
            return

        def factory():
            return httpx2.Client(event_hooks={"request": [hf_request_event_hook]},
                                 follow_redirects=True, timeout=None,
                                 transport=RetryTransport(sleep=sleep))

        set_client_factory(factory)
        _installed = sleep is time.sleep
