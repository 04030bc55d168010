"""The nonce cache behind replay refusal: a nonce is refused while its window lasts and forgotten after, and a
clock that steps back makes it forgotten late, never early."""

from orchestrator.auth import NonceCache


def test_a_nonce_is_refused_until_it_expires_then_forgotten():
    cache = NonceCache()
    assert cache.add("aa" * 8, expires=100.0)
    assert not cache.add("aa" * 8, expires=130.0)  # a replay
    assert cache.add("bb" * 8, expires=110.0)
    cache.prune(now=99.0)
    assert len(cache) == 2 and not cache.add("aa" * 8, expires=160.0)
    cache.prune(now=100.0)  # "aa" expired at 100: forgotten, "bb" kept
    assert len(cache) == 1
    assert not cache.add("bb" * 8, expires=170.0)
    assert cache.add("aa" * 8, expires=170.0)  # a nonce may come back once forgotten (its timestamp is stale by then)


def test_a_clock_that_steps_back_forgets_late_never_early():
    cache = NonceCache()
    cache.add("01" * 8, expires=200.0)
    cache.add("02" * 8, expires=150.0)  # the clock stepped back between the two
    cache.prune(now=160.0)
    assert not cache.add("02" * 8, expires=300.0)  # still held: it sits behind an entry that has not expired
    assert not cache.add("01" * 8, expires=300.0)
    cache.prune(now=200.0)
    assert len(cache) == 0
