"""The speedup model against hand-computed cases, docs/algorithm.md section 8 and its limits."""

from __future__ import annotations

import json
import random

import pytest

from trtssd.plan import load_timings, main
from trtssd.runtime.calibration import time_forwards, time_tree_steps
from trtssd.spec_decode.speedup import (CostCurve, StepCostModel, Timings, Workload, acceptance_from_length, best_ssd,
                                        expected_tokens, predict_ar, predict_sd, predict_ssd, recommend)
from trtssd.spec_decode.fanout import expected_hit_rate, optimal_fanout


def unit_timings(draft: float, tree: float | None = None, **kw) -> Timings:
    """A verify of any size costs 1 (the unit of section 8); drafting costs ``draft`` per pass."""
    return Timings(CostCurve(((1, 1.0),)), CostCurve(((1, draft),)),
                   CostCurve(((1, tree),)) if tree is not None else None, **kw)


def section8_ssd(h: float, e: float, e_miss: float, t_p: float, t_b: float) -> float:
    """The formula exactly as docs/algorithm.md writes it (tokens per unit verify)."""
    return (h * e + (1 - h) * e_miss) / (h * max(1, t_p) + (1 - h) * (t_b + max(1, t_p)))


# --- component pieces ----------------------------------------------------------------------------


def test_cost_curve_interpolates_and_extrapolates_linearly():
    c = CostCurve(((8, 0.030), (1, 0.010), (4, 0.020)))  # unsorted on purpose
    assert c(1) == pytest.approx(0.010)
    assert c(0.5) == pytest.approx(0.010)  # never cheaper than the smallest measured pass
    assert c(2.5) == pytest.approx(0.015)
    assert c(6) == pytest.approx(0.025)
    assert c(16) == pytest.approx(0.050)  # last slope 0.0025/token continues
    assert CostCurve(((1, 0.02),))(500) == 0.02
    falling = CostCurve(((1, 0.02), (2, 0.01)))  # noisy calibration: the last segment falls
    assert falling(5) == falling(100) == 0.01  # bigger passes never predicted cheaper, nor free
    assert CostCurve.parse("1:0.01,4:0.02")(2.5) == pytest.approx(0.015)
    assert CostCurve.parse("0.3")(7) == 0.3


@pytest.mark.parametrize("points, match", [
    ((), "at least one"), (((1, -0.1),), "seconds"), (((0, 0.1),), "tokens"), (((2, 0.1), (2, 0.2)), "repeated"),
])
def test_bad_cost_curves(points, match):
    with pytest.raises(ValueError, match=match):
        CostCurve(points)


def test_cost_curve_parse_error_names_the_flag():
    with pytest.raises(ValueError, match="--target-cost"):
        CostCurve.parse("1:x", "--target-cost")


def test_component_times_map_onto_pass_sizes():
    t = Timings(CostCurve(((1, 1.0), (100, 100.0))), CostCurve(((1, 0.1), (100, 10.0))))
    assert t.target(3) == pytest.approx(3.0)
    assert t.verify(4, 3) == pytest.approx(15.0)  # 3 sequences x (K+1) tokens
    assert t.glue(4, 2) == pytest.approx(1.0)
    assert t.tree_step(6, 2) == pytest.approx(1.2)  # the tree curve defaults to the draft's
    assert t.prespeculation(4, 6, 2) == pytest.approx(1.0 + 4 * 1.2)
    assert t.prespeculation(4, 0, 2) == pytest.approx(1.0)


def test_expected_tokens_and_its_inverse():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    for a in (0.0, 0.3, 0.77, 0.95):
        assert acceptance_from_length(expected_tokens(a, 5), 5) == pytest.approx(a, abs=1e-9)
    assert acceptance_from_length(1.0, 5) == 0.0 and acceptance_from_length(6.0, 5) == 1.0
    with pytest.raises(ValueError, match="K\\+1"):
        acceptance_from_length(7.0, 5)


# --- the three modes -----------------------------------------------------------------------------


def test_ar_and_sd_hand_computed():
    t = unit_timings(0.1, handshake_s=0.0)
    assert predict_ar(t).tokens_per_s == pytest.approx(1.0)
    sd = predict_sd(t, Workload(0.5), k=2)
    assert sd.tokens_per_round == pytest.approx(1.75)
    assert sd.tokens_per_s == pytest.approx(1.75 / 1.2)  # E / (1 + T_SD), T_SD = 2 x 0.1
    with_costs = predict_sd(unit_timings(0.1, handshake_s=0.05, overhead_s=0.15), Workload(0.5), k=2)
    assert with_costs.round_time_s == pytest.approx(1.4)


def test_ssd_hand_computed_both_backups():
    t = unit_timings(0.1)
    w = Workload(0.5, hit_rate=0.6)
    neural = predict_ssd(t, w, k=2, budget=4)
    # T_p = glue 0.1 + 2 tree steps of 0.1 = 0.3 fits in the verify; a miss re-drafts for 0.2.
    assert neural.draft_fits is True
    assert neural.tokens_per_s == pytest.approx(1.75 / (1 + 0.4 * 0.2))
    fast = predict_ssd(t, w, k=2, budget=4, backup="fast")
    assert fast.tokens_per_s == pytest.approx(0.6 * 1.75 + 0.4 * 1.0)
    slow_draft = predict_ssd(unit_timings(0.5), Workload(0.5, hit_rate=0.5), k=2, budget=4)
    assert slow_draft.draft_fits is False
    assert slow_draft.tokens_per_s == pytest.approx(1.75 / (1.5 + 0.5 * 1.0))


def test_ssd_equals_the_section8_formula_on_random_inputs():
    rng = random.Random(0)
    for _ in range(200):
        a, h, k, budget = rng.random(), rng.random(), rng.randint(1, 8), rng.randint(1, 16)
        d, tr = rng.uniform(0.01, 0.5), rng.uniform(0.01, 0.3)
        t = unit_timings(d, tree=tr)
        w = Workload(a, hit_rate=h, fast_acceptance=rng.random() * 0.5)
        e = expected_tokens(a, k)
        t_p = d + k * tr
        assert predict_ssd(t, w, k, budget).tokens_per_s == pytest.approx(section8_ssd(h, e, e, t_p, k * d))
        e_fast = expected_tokens(w.fast_acceptance, k)
        assert predict_ssd(t, w, k, budget, backup="fast").tokens_per_s == pytest.approx(
            section8_ssd(h, e, e_fast, t_p, 0.0))


def test_limits_ssd_over_sd_bound_and_e_per_verify():
    rng = random.Random(1)
    for _ in range(300):
        b = rng.randint(1, 8)
        t = Timings(CostCurve(((1, rng.uniform(0.005, 0.05)), (64, rng.uniform(0.05, 0.3)))),
                    CostCurve(((1, rng.uniform(0.001, 0.02)), (64, rng.uniform(0.02, 0.1)))),
                    handshake_s=rng.uniform(0, 0.002), overhead_s=rng.uniform(0, 0.002))
        w = Workload(rng.random(), hit_rate=rng.random())
        k, budget = rng.randint(1, 8), rng.randint(1, 24)
        sd = predict_sd(t, w, k, b)
        t_sd = k * t.draft(b) / t.verify(k, b)
        for backup in ("neural", "fast"):
            ssd = predict_ssd(t, w, k, budget, b, backup)
            assert ssd.tokens_per_s / sd.tokens_per_s <= 1 + t_sd + 1e-12
    # h -> 1 and T_p <= 1: drafting fully hidden, E tokens per verify.
    t = unit_timings(0.05)
    w = Workload(0.8, hit_rate=1.0)
    for k in range(1, 9):
        ssd = predict_ssd(t, w, k, budget=2)
        assert ssd.draft_fits
        assert ssd.tokens_per_s == pytest.approx(expected_tokens(0.8, k))


def test_ssd_overlaps_the_target_host_overhead_with_drafting():
    w = Workload(0.5, hit_rate=1.0)
    hidden = predict_ssd(unit_timings(0.1, overhead_s=0.2, handshake_s=0.05), w, k=2, budget=4)
    assert hidden.round_time_s == pytest.approx(0.05 + 1.2) and hidden.draft_fits  # T_p 0.3 < 1.2
    bound = predict_ssd(unit_timings(0.5, overhead_s=0.2, handshake_s=0.05), w, k=2, budget=4)
    assert bound.round_time_s == pytest.approx(0.05 + 1.5) and not bound.draft_fits  # T_p 1.5 > 1.2


def test_batch_neural_backup_waits_for_the_missing_rows():
    t = Timings(CostCurve(((1, 1.0),)), CostCurve(((1, 0.1), (2, 0.15))))
    p = predict_ssd(t, Workload(0.5, hit_rate=0.5), k=2, budget=1, batch_size=2)
    # one miss (prob 0.5) re-drafts 1 row: 2 x 0.1; two misses (0.25) re-draft 2 rows: 2 x 0.15.
    t_p = t.draft(6) + 2 * t.draft(2)
    assert p.round_time_s == pytest.approx(max(1.0, t_p) + 0.5 * 0.2 + 0.25 * 0.3)
    assert p.tokens_per_s == pytest.approx(2 * 1.75 / p.round_time_s)


def test_hit_rate_predicted_from_the_optimal_fanout():
    w = Workload(0.5, r=1.0, c=0.5)
    p = predict_ssd(unit_timings(0.1), w, k=1, budget=2)
    # pi = (0.5, 0.5): F=(1,1) gives 0.5 (1-0.5) * 2 = 0.5, better than (2,0) or (0,2) at 0.375.
    assert p.fanout == (1, 1) and p.hit_rate == pytest.approx(0.5)
    p7 = predict_ssd(unit_timings(0.1), Workload(0.8), k=7, budget=24)
    assert p7.fanout == tuple(optimal_fanout(24, 7, 0.8, 1.0, 0.5))
    assert p7.hit_rate == pytest.approx(expected_hit_rate(p7.fanout, 0.8, 1.0, 0.5))
    with pytest.raises(ValueError, match="fanout"):
        predict_ssd(unit_timings(0.1), w, k=1, budget=2, fanout=(2, 1))


def test_recommend_returns_the_fastest_candidates():
    t = Timings(CostCurve(((1, 0.02), (8, 0.024), (64, 0.05))), CostCurve(((1, 0.004), (64, 0.008))),
                handshake_s=0.0005)
    rec = recommend(t, Workload(0.8), batch_size=1, ks=range(1, 7), budgets=(2, 6, 12))
    ssd = [c for c in rec.candidates if c.mode.startswith("ssd")]
    sd = [c for c in rec.candidates if c.mode == "sd"]
    assert len(ssd) == 6 * 3 * 2 and len(sd) == 6
    assert rec.ssd.tokens_per_s == max(c.tokens_per_s for c in ssd)
    assert rec.sd.tokens_per_s == max(c.tokens_per_s for c in sd)
    assert rec.ssd_speedup_over_ar > rec.sd.tokens_per_s / rec.ar.tokens_per_s > 1


def test_a_draft_as_slow_as_the_target_makes_sd_lose_to_ar():
    t = unit_timings(1.0)
    rec = recommend(t, Workload(0.5), ks=(1, 2, 3), budgets=(1,))
    assert rec.sd.tokens_per_s < rec.ar.tokens_per_s
    assert rec.best.tokens_per_s == max(rec.ar.tokens_per_s, rec.sd.tokens_per_s, rec.ssd.tokens_per_s)


@pytest.mark.parametrize("kwargs, field", [
    (dict(acceptance=1.5), "acceptance"), (dict(acceptance=0.5, hit_rate=-0.1), "hit_rate"),
    (dict(acceptance=0.5, r=0), "r"), (dict(acceptance=0.5, c=0), "c"),
])
def test_bad_workload(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Workload(**kwargs)


def test_bad_arguments_name_the_field():
    t = unit_timings(0.1)
    with pytest.raises(ValueError, match="batch_size"):
        predict_ar(t, 0)
    with pytest.raises(ValueError, match="k"):
        predict_sd(t, Workload(0.5), 0)
    with pytest.raises(ValueError, match="backup"):
        predict_ssd(t, Workload(0.5), 2, 4, backup="random")
    with pytest.raises(ValueError, match="handshake_s"):
        unit_timings(0.1, handshake_s=-1.0)


# --- files and command line ----------------------------------------------------------------------


def test_timings_round_trip_json_and_yaml(tmp_path):
    t = Timings(CostCurve(((1, 0.02), (8, 0.03))), CostCurve(((1, 0.004),)), CostCurve(((4, 0.006),)),
                handshake_s=0.001, overhead_s=0.002, name="gpu guess")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t.to_dict()))
    assert load_timings(path) == t
    yaml_path = tmp_path / "t.yaml"
    yaml_path.write_text("name: h100\ntarget: {1: 0.018, 512: 0.03}\ndraft: {1: 0.004}\nhandshake_s: 0.0002\n")
    y = load_timings(yaml_path)
    assert y.target(256.5) == pytest.approx(0.024) and y.handshake_s == 0.0002 and y.tree is None
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": [], "timings": t.to_dict()}))
    assert load_timings(results) == t
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"target": {"1": 0.1}, "draft": {"1": 0.1}, "verify": 3}))
    with pytest.raises(ValueError, match="verify"):
        load_timings(bad)


def test_main_prints_a_table_from_flags(capsys):
    assert main(["--target-cost", "1:0.02,8:0.024", "--draft-cost", "1:0.004", "--acceptance", "0.8",
                 "--batch", "1,2", "--k", "2-4", "--budgets", "4,8"]) == 0
    out = capsys.readouterr().out
    assert "| 1 | ar |" in out and "| 2 | sd |" in out and "batch 2: use ssd; best ssd: K=" in out


def test_main_json_and_missing_costs(tmp_path, capsys):
    assert main(["--target-cost", "0.02", "--draft-cost", "0.004", "--mean-acceptance-length", "3",
                 "--measured-k", "4", "--hit-rate", "0.9", "--k", "4", "--budgets", "8", "--json",
                 "--save-timings", str(tmp_path / "saved.json")]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["workload"]["acceptance"] == pytest.approx(acceptance_from_length(3, 4))
    assert payload["batches"][0]["best"]["ssd"]["hit_rate"] == 0.9
    assert load_timings(tmp_path / "saved.json").target(1) == 0.02
    with pytest.raises(SystemExit):
        main(["--draft-cost", "0.004"])
    assert "--target-cost" in capsys.readouterr().err


@pytest.mark.slow
def test_main_measures_tiny_models_on_this_machine(tmp_path, capsys):
    from tiny_models import make_tiny_llama

    target = make_tiny_llama(tmp_path / "target", seed=0)
    draft = make_tiny_llama(tmp_path / "draft", seed=1)
    saved = tmp_path / "measured.json"
    assert main(["--measure", "--target", str(target), "--draft", str(draft), "--k", "2,3", "--budgets", "2,4",
                 "--batch", "1,2", "--save-timings", str(saved)]) == 0
    t = load_timings(saved)
    # 1-token steps and (K+1)-token chains for batch 1 and 2; tree steps of b x budget tokens.
    assert [n for n, _ in t.target.points] == [1, 2, 3, 4, 6, 8]
    assert [n for n, _ in t.tree.points] == [2, 4, 8]
    assert all(s > 0 for _, s in t.target.points + t.draft.points)
    assert "batch 2:" in capsys.readouterr().out


# --- the draft rank's live use: StepCostModel and best_ssd over budgets ---------------------------


def test_time_forwards_on_a_scratch_sequence(tmp_path):
    from tiny_models import make_tiny_llama

    from trtssd.backends.torch_backend import TorchExecutor

    ex = TorchExecutor.from_pretrained(make_tiny_llama(tmp_path / "m", seed=0), max_seqs=1, max_seq_len=64)
    points = time_forwards(ex, max_rows=16, context=16, repeats=1)
    assert sorted(points) == [1, 2, 4, 8, 16] and all(s > 0 for s in points.values())
    ex.add_sequence(0)  # the scratch sequence was released: its slot is free for a request


def test_time_tree_steps_only_as_wide_as_the_sequence_holds(tmp_path):
    from tiny_models import make_tiny_llama

    from trtssd.backends.torch_backend import TorchExecutor

    ex = TorchExecutor.from_pretrained(make_tiny_llama(tmp_path / "m", seed=0), max_seqs=1, max_seq_len=64)
    # 16 context + 4 glue + 3 steps x 16 branches = 68 slots > 64: 16 branches are not timed.
    points = time_tree_steps(ex, k=3, max_branches=16, context=16, repeats=1)
    assert sorted(points) == [1, 2, 4, 8] and all(s > 0 for s in points.values())
    ex.add_sequence(0)


def test_step_cost_model_interpolates_and_follows_load():
    m = StepCostModel(decay=0.5)
    m.calibrate({1: 0.030, 4: 0.045, 16: 0.120})
    assert m.predict(1) == pytest.approx(0.030)
    assert m.predict(2) == pytest.approx(0.035)  # between 1 and 4
    assert m.predict(32) == pytest.approx(0.220)  # extrapolated with the last slope
    m.observe(4, 0.090)  # the machine got twice as slow
    assert m.scale == pytest.approx(1.5)
    assert m.predict(16) == pytest.approx(0.180)
    assert m.curve()(16) == pytest.approx(0.180)
    with pytest.raises(ValueError, match="rows >= 1"):
        m.calibrate({0: 0.1})


def test_step_cost_model_survives_a_falling_calibration():
    """Forwards wider than the calibration after a noisy, falling last segment (seen in CI: the
    draft rank died dividing by a predicted 0 s)."""
    m = StepCostModel(decay=0.5)
    m.calibrate({1: 0.002, 2: 0.001})
    m.observe(40, 0.004)
    assert m.predict(40) > 0 and m.scale == pytest.approx(2.5)


def _budget_plan(calibration: dict[int, float], verify_s: float, a: float, c: float = 0.3, budget: int = 12) -> list[int]:
    """What the draft rank does each round: recommend over budgets 1..budget from live costs."""
    m = StepCostModel()
    m.calibrate(calibration)
    t = Timings(CostCurve(((1.0, verify_s),)), m.curve())
    best = best_ssd(t, Workload(a, r=1.0, c=c), 1, ks=(5,), budgets=range(1, budget + 1), backups=("neural",))
    return list(best.fanout)


def test_best_ssd_is_recommends_ssd_with_one_fanout_per_budget():
    """The draft's per-round search optimises each budget's fan-out once for both backups and
    skips ar and sd; it must pick what the full recommendation picks."""
    t = Timings(CostCurve(((1.0, 0.08),)), CostCurve(((1, 0.004), (8, 0.011), (64, 0.075))), fast_backup_s=1e-4)
    w = Workload(0.72, r=0.9, c=0.45, fast_acceptance=0.05)
    for batch in (1, 4, 8):
        best = best_ssd(t, w, batch, ks=(5,), budgets=range(1, 13))
        assert best == recommend(t, w, batch, ks=(5,), budgets=range(1, 13)).ssd
        assert best == max((predict_ssd(t, w, 5, bud, batch, backup) for bud in range(1, 13)
                            for backup in ("neural", "fast")), key=lambda p: p.tokens_per_s)


def test_budget_uses_all_of_it_when_width_is_free():
    # GPU-like: a forward costs the same for 1 or 64 rows, and verify hides the whole tree.
    fan = _budget_plan({1: 0.001, 64: 0.001}, verify_s=0.02, a=0.7)
    assert sum(fan) == 12 and fan == optimal_fanout(12, 5, 0.7, 1.0, 0.3)


def test_budget_narrows_the_tree_when_rows_cost_time():
    # CPU-like: every row costs, the tree cannot hide behind verify; near-certain acceptance and
    # a draft whose top guess is nearly always the bonus (greedy) put the only candidate at
    # depth K (the bonus after accepting everything).
    fan = _budget_plan({1: 0.03, 2: 0.035, 4: 0.045, 16: 0.12, 64: 0.45}, verify_s=0.1, a=0.99, c=0.02)
    assert fan == [0, 0, 0, 0, 0, 1]


def test_budget_widens_when_verify_is_long_enough_to_hide_it():
    cal = {1: 0.03, 2: 0.035, 4: 0.045, 16: 0.12, 64: 0.45}
    narrow = sum(_budget_plan(cal, verify_s=0.1, a=0.8))
    wide = sum(_budget_plan(cal, verify_s=2.0, a=0.8))
    assert wide > narrow and wide == 12


def test_recommend_rejects_empty_choices():
    t = Timings(CostCurve(((1.0, 0.1),)), CostCurve(((1.0, 0.01),)))
    with pytest.raises(ValueError, match="budgets and backups must be non-empty"):
        recommend(t, Workload(0.5), 1, ks=(5,), budgets=range(1, 1))
    with pytest.raises(ValueError, match="batch"):
        recommend(t, Workload(0.5), 0, ks=(5,), budgets=(4,))


# --- a tensor-parallel target (--tensor-parallel-size) --------------------------------------------


def test_a_split_target_costs_a_rank_plus_its_collectives():
    from trtssd.plan import TensorParallelCosts

    single = CostCurve(((1, 0.040), (64, 0.080)))
    allreduce = CostCurve(((1, 1e-5), (16, 2e-5)))
    gather = CostCurve(((1, 3e-5),))
    split = TensorParallelCosts(4, 10, allreduce, gather)
    target = split.target(single)
    for n in (1, 8, 16, 40, 64, 200):  # exact at and between every part's points, and past them
        assert target(n) == pytest.approx(single(n) / 4 + 20 * allreduce(n) + gather(n), rel=1e-12)
    rank = CostCurve(((1, 0.012),))  # a measured shard overrides target / T
    assert TensorParallelCosts(4, 10, allreduce, None, rank).target(single)(1) == pytest.approx(0.012 + 20 * 1e-5)
    with pytest.raises(ValueError, match="--layers must be a positive integer"):
        TensorParallelCosts(4, 0, allreduce)


def test_plan_predicts_a_split_target_from_flags_or_a_collectives_file(tmp_path, capsys):
    base = ["--target-cost", "1:0.040,64:0.080", "--draft-cost", "1:0.004", "--batch", "1", "--k", "3",
            "--budgets", "4", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--tensor-parallel-size", "4", "--layers", "10", "--allreduce-cost", "1:0.0001"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert split["timings"]["target"]["1"] == pytest.approx(0.010 + 20 * 0.0001)
    assert split["timings"]["draft"] == plain["timings"]["draft"]  # the draft keeps its device
    ar = [b["best"]["ar"]["tokens_per_s"] for b in (plain["batches"][0], split["batches"][0])]
    assert ar[1] == pytest.approx(1 / (0.010 + 0.002), abs=1e-3) and ar[1] > ar[0]  # JSON rounds to 3 places
    measured = tmp_path / "collectives.json"  # what docs/bench/tensor-parallel-collectives/run.sh writes
    measured.write_text(json.dumps({"size": 4, "hidden": 8192, "allreduce": {"1": 0.0001, "64": 0.0003},
                                    "allgather": {"1": 0.0002}}))
    assert main(base + ["--tensor-parallel-size", "4", "--layers", "10", "--collectives", str(measured)]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert from_file["timings"]["target"]["1"] == pytest.approx(0.010 + 20 * 0.0001 + 0.0002)
    assert main(base[:-1] + ["--tensor-parallel-size", "4", "--layers", "10", "--collectives", str(measured)]) == 0
    assert "target on 4 ranks" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--layers", "10"], "--layers needs --tensor-parallel-size > 1"),
    (["--tensor-parallel-size", "4", "--layers", "10"], "needs --allreduce-cost or --collectives"),
    (["--tensor-parallel-size", "4", "--allreduce-cost", "1e-5"], "needs --layers"),
    (["--tensor-parallel-size", "2", "--layers", "10", "--collectives", "{file}"], "measured 4 ranks"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
])
def test_plan_refuses_an_incomplete_split(tmp_path, capsys, flags, message):
    measured = tmp_path / "c.json"
    measured.write_text(json.dumps({"size": 4, "allreduce": {"1": 0.0001}}))
    flags = [f.format(file=measured) for f in flags]
    with pytest.raises(SystemExit):
        main(["--target-cost", "0.04", "--draft-cost", "0.004"] + flags)
    assert message in capsys.readouterr().err
