"""The step policy: who joins, who feeds how many tokens. Plain data, a fake clock."""

import pytest

from daskflow_kv.policy.step_schedule import Seq, chunk, plan_step


def _drive(arrivals, prompts, step_tokens, max_running, decode=4, align=0):
    """Run the policy alone over a fake clock (one step = one tick); -> per-request
    (tick it joined, tick its prompt was fed, tick it finished), and steps' token counts."""
    waiting = {i: Seq(i, arrivals[i], prompts[i], 0, align=align) for i in range(len(prompts))}
    running: dict[int, Seq] = {}
    left = {i: decode for i in waiting}
    joined, prompt_done, finished, sizes = {}, {}, {}, []
    tick = 0
    while waiting or running:
        ready = [s for s in waiting.values() if s.arrived <= tick]
        plan = plan_step(list(running.values()), ready, step_tokens, max_running)
        for rid in plan.joined:
            running[rid] = waiting.pop(rid)
            joined[rid] = tick
        sizes.append(plan.tokens)
        for rid, n in plan.feeds:
            s = running[rid]
            if s.decoding:
                left[rid] -= 1
                if left[rid] == 0:
                    finished[rid] = tick
                    del running[rid]
                else:
                    running[rid] = Seq(rid, s.arrived, 0, s.position + 1, align=align)
            else:
                running[rid] = Seq(rid, s.arrived, s.to_prefill - n, s.position + n, align=align)
                if s.to_prefill == n:
                    prompt_done[rid] = tick
        tick += 1
        assert tick < 10_000
    return joined, prompt_done, finished, sizes


def test_decodes_feed_every_step_and_prefill_takes_the_rest():
    running = [Seq(0, 0.0, 0, 100), Seq(1, 1.0, 0, 90)]
    waiting = [Seq(2, 2.0, 700, 0)]
    plan = plan_step(running, waiting, step_tokens=512, max_running=8)
    assert plan.joined == (2,)
    assert plan.feeds == ((0, 1), (1, 1), (2, 510))
    assert plan.tokens == 512


def test_joins_in_arrival_order_up_to_max_running():
    waiting = [Seq(5, 3.0, 10, 0), Seq(4, 1.0, 10, 0), Seq(6, 2.0, 10, 0)]
    plan = plan_step([Seq(0, 0.0, 0, 5)], waiting, step_tokens=64, max_running=3)
    assert plan.joined == (4, 6)  # oldest first, two places left
    assert [r for r, _ in plan.feeds] == [0, 4, 6]


def test_the_oldest_prompt_always_advances():
    """More decodes than the budget: the oldest prefilling request still feeds a chunk."""
    running = [Seq(i, float(i), 0, 10) for i in range(8)] + [Seq(8, 8.0, 300, 0), Seq(9, 9.0, 300, 0)]
    plan = plan_step(running, [], step_tokens=4, max_running=16)
    assert plan.fed(8) >= 1 and plan.fed(9) == 0
    assert all(plan.fed(i) == 1 for i in range(8))


def test_aligned_chunks_end_on_block_boundaries():
    s = Seq(0, 0.0, 200, 40, align=64)  # resumed at 40: first chunk up to 64, then whole blocks
    assert chunk(s, 1000) == 24
    assert chunk(Seq(0, 0.0, 176, 64, align=64), 1000) == 64
    assert chunk(Seq(0, 0.0, 176, 64, align=64), 63) == 0  # a shorter chunk would round differently
    assert chunk(Seq(0, 0.0, 10, 64, align=64), 63) == 10


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match="step_tokens"):
        plan_step([], [], 0, 4)


def test_newcomer_ttft_is_its_prefill_plus_at_most_one_step_of_waiting():
    """Seven requests decode; an eighth arrives: it joins at once and its whole prompt is fed
    in its first step (budget >= prompt), beside the seven decode rows."""
    arrivals = [0] * 7 + [20]
    joined, prompt_done, finished, sizes = _drive(arrivals, [64] * 7 + [400], step_tokens=512, max_running=8,
                                                  decode=40)
    assert joined[7] == 20 and prompt_done[7] == 20
    assert sizes[20] == 7 + 400


def test_every_request_finishes_and_fairly():
    """A stream with more requests than places: all finish, in arrival order of joining."""
    arrivals = [i * 3 for i in range(12)]
    joined, prompt_done, finished, sizes = _drive(arrivals, [100 + 37 * i for i in range(12)], step_tokens=128,
                                                  max_running=4, decode=6)
    assert set(finished) == set(range(12))
    assert [joined[i] for i in range(12)] == sorted(joined[i] for i in range(12))
    assert max(sizes) <= 128 + 128 // 8  # the budget binds, up to a prompt's last chunk's slack


def test_a_prompt_nearly_done_ends_in_this_step():
    """Seven decode rows leave 505 of 512 tokens: a 512-token prompt ends now (7 over the
    budget) rather than in a step of its own for 7 tokens; a longer remainder is chunked."""
    running = [Seq(i, float(i), 0, 600) for i in range(7)]
    plan = plan_step(running, [Seq(7, 7.0, 512, 0)], step_tokens=512, max_running=8)
    assert plan.fed(7) == 512 and plan.tokens == 519
    plan = plan_step(running, [Seq(7, 7.0, 512 + 64, 0)], step_tokens=512, max_running=8)
    assert plan.fed(7) == 505  # 71 tokens would be left: past the slack of 512 // 8
    plan = plan_step(running, [Seq(7, 7.0, 512, 0)], step_tokens=512, max_running=8, finish_slack=0)
    assert plan.fed(7) == 505
    assert chunk(Seq(0, 0.0, 70, 0), 0, finish_slack=100) == 0  # no room: no chunk, slack or not
