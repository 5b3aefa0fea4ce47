"""The per-caller limiter's core: windows over the last 60 s, decisions that change nothing when
they refuse, and the Retry-After each refusal gives."""

from __future__ import annotations

from appliance.api.limiter import MAX_TRACKED_KEYS, WINDOW_S, Budget, Exceeded, Key, Limiter

ALICE = Key("subject", "https://idp alice")
BOB = Key("subject", "https://idp bob")
USERS = Key("role", "user")


def test_a_concurrency_limit_refuses_until_a_request_ends() -> None:
    limiter = Limiter()
    budgets = {ALICE: Budget(max_concurrent_requests=2)}
    assert limiter.admit(budgets, now=0.0) is None
    assert limiter.admit(budgets, now=0.0) is None
    assert limiter.admit(budgets, now=0.0) == Exceeded(ALICE, "max_concurrent_requests", 2, None)
    limiter.release([ALICE], 0, now=1.0)
    assert limiter.admit(budgets, now=1.0) is None


def test_requests_per_minute_slide_and_retry_after_names_when_room_comes() -> None:
    limiter = Limiter()
    budgets = {ALICE: Budget(requests_per_minute=2)}
    for now in (0.0, 10.0):
        assert limiter.admit(budgets, now) is None
        limiter.release([ALICE], 0, now)
    assert limiter.admit(budgets, now=30.0) == Exceeded(ALICE, "requests_per_minute", 2, 30)
    assert limiter.admit(budgets, now=59.5) == Exceeded(ALICE, "requests_per_minute", 2, 1)
    assert limiter.admit(budgets, now=WINDOW_S) is None, "the first request left the window"


def test_tokens_are_charged_at_the_end_and_admit_while_the_budget_is_not_spent() -> None:
    limiter = Limiter()
    budgets = {ALICE: Budget(tokens_per_minute=100)}
    assert limiter.admit(budgets, now=0.0) is None
    assert limiter.admit(budgets, now=0.0) is None, "nothing is charged before a request ends"
    limiter.release([ALICE], 70, now=5.0)
    assert limiter.admit(budgets, now=6.0) is None, "70 of 100 spent: admitted"
    limiter.release([ALICE], 50, now=7.0)  # the last admitted request may overrun the budget
    limiter.release([ALICE], 10, now=8.0)
    # 130 spent; below 100 once the 70 charged at 5 s leave the window, at 65 s.
    assert limiter.admit(budgets, now=9.0) == Exceeded(ALICE, "tokens_per_minute", 100, 56)
    assert limiter.admit(budgets, now=65.0) is None


def test_a_refusal_by_one_key_charges_none_of_the_others() -> None:
    limiter = Limiter()
    full = {USERS: Budget(max_concurrent_requests=1)}
    assert limiter.admit(full, now=0.0) is None
    refused = limiter.admit({ALICE: Budget(max_concurrent_requests=5), **full}, now=0.0)
    assert refused is not None and refused.key == USERS
    assert limiter.num_in_flight(ALICE) == 0


def test_one_callers_usage_leaves_another_unaffected() -> None:
    limiter = Limiter()
    budget = Budget(max_concurrent_requests=1, requests_per_minute=1)
    assert limiter.admit({ALICE: budget}, now=0.0) is None
    assert limiter.admit({ALICE: budget}, now=0.0) is not None
    assert limiter.admit({BOB: budget}, now=0.0) is None


def test_no_limit_admits_everything_and_idle_keys_are_forgotten() -> None:
    limiter = Limiter()
    for _ in range(1000):
        assert limiter.admit({ALICE: Budget()}, now=0.0) is None
    for _ in range(1000):
        limiter.release([ALICE], 5, now=1.0)
    limiter.admit({BOB: Budget()}, now=WINDOW_S + 2)
    limiter.release([BOB], 0, now=WINDOW_S + 2)
    assert limiter.num_in_flight(ALICE) == 0


def test_the_table_of_keys_is_bounded_and_keeps_keys_with_requests_in_flight() -> None:
    limiter = Limiter()
    budget = {ALICE: Budget(max_concurrent_requests=1)}
    assert limiter.admit(budget, now=0.0) is None
    for index in range(MAX_TRACKED_KEYS + 10):
        key = Key("attestation", f"10.0.{index // 256}.{index % 256}")
        assert limiter.admit({key: Budget(requests_per_minute=1)}, now=1.0) is None
        limiter.release([key], 0, now=1.0)
    assert limiter.num_in_flight(ALICE) == 1
    assert limiter.admit(budget, now=2.0) is not None
