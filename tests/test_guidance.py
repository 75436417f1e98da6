"""Discriminator-guided decoding and its calibration: pure logic with exact values, and the go/no-go's pooled
paired difference."""

import numpy as np
import pytest

from adversary.guidance import Guide, choose, effective_sample_size, split_by_conversation
from adversary.guided import GuidedConfig, candidate_window, pooled_difference
from adversary.heldout import mean_rows
from conversations import TurnRecord
from conversations.config import ConfigError
from discriminator.calibration import PlattScaler, calibration_report, expected_calibration_error


def test_argmax_and_resample_pick_by_the_weights():
    z = np.array([[0.0, 3.0, 1.0], [-5.0, -5.0, 2.0]])
    assert choose(z, "argmax", np.random.default_rng(0)).tolist() == [1, 2]
    # resampling draws index j with probability exp(z_j) / sum exp(z): row 0 -> [0.035, 0.844, 0.114]
    rng = np.random.default_rng(0)
    draws = np.stack([choose(z, "resample", rng) for _ in range(20000)])  # (20000, 2)
    freq = np.bincount(draws[:, 0], minlength=3) / len(draws)
    p = np.exp(z[0]) / np.exp(z[0]).sum()
    assert np.allclose(freq, p, atol=0.01)
    assert choose(np.array([[800.0, 0.0]]), "resample", rng).tolist() == [0]  # no overflow
    with pytest.raises(ValueError, match="unknown rule"):
        choose(z, "mode", rng)


def test_effective_sample_size():
    assert effective_sample_size(np.zeros((1, 8))).tolist() == [8.0]
    assert effective_sample_size(np.array([[100.0, 0.0, 0.0]]))[0] == pytest.approx(1.0)


def test_expected_calibration_error_exact():
    # bin [0.1, 0.2): two items at 0.1, one real -> |1 - 0.2| ; bin [0.9, 1]: 0.9, 0.9, 1.0, all real -> |3 - 2.8|
    assert expected_calibration_error([0.1, 0.1, 0.9, 0.9, 1.0], [0, 1, 1, 1, 1]) == pytest.approx(0.2)
    assert expected_calibration_error([0.5, 0.5], [0, 1]) == pytest.approx(0.0)


def test_platt_scaling_fixes_an_overconfident_scorer():
    rng = np.random.default_rng(0)
    s = rng.normal(size=4000)
    y = (rng.random(4000) < 1 / (1 + np.exp(-s))).astype(int)  # s is the calibrated log-odds
    scaler = PlattScaler().fit(4 * s, y)  # an over-confident scorer: 4x the log-odds
    assert scaler.a == pytest.approx(0.25, abs=0.03) and abs(scaler.b) < 0.1
    rep = calibration_report(4 * s, y, scaler)
    assert rep["calibrated"]["ece"] < 0.03 < rep["raw"]["ece"]
    assert rep["calibrated"]["log_loss"] < rep["raw"]["log_loss"]


def test_mean_rows_averages_numbers_and_reports_the_seed_spread():
    rows = [{"td/panel": 20.0, "td/ci_low": 16.0, "td/headline": "classical", "diag/x": 1},
            {"td/panel": 24.0, "td/ci_low": 18.0, "td/headline": "style", "diag/x": 3}]
    m = mean_rows(rows)
    assert m["td/panel"] == 22.0 and m["td/ci_low"] == 17.0 and m["diag/x"] == 2.0
    assert m["td/headline"] == "classical" and m["td/seeds"] == 2
    assert m["td/seed_sd"] == pytest.approx(np.std([20.0, 24.0], ddof=1))
    assert mean_rows(rows[:1])["td/seeds"] == 1


def test_pooled_difference_is_the_mean_over_seeds_of_the_panel_td_difference():
    # 4 contexts, 1 detector, 2 items per context (real, simulated); every resample = all contexts once
    ctx = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    a = [np.array([[1, 1, 1, 1, 0, 0, 1, 0]], bool), np.array([[1, 0, 1, 0, 1, 0, 1, 0]], bool)]  # 62.5%, 50%
    b = [np.ones((1, 8), bool), np.array([[1, 1, 1, 1, 1, 1, 0, 0]], bool)]  # 100%, 75%
    counts = np.ones((3, 4), dtype=np.int64)
    d = pooled_difference(a, b, [ctx, ctx], counts)
    assert d.tolist() == [((12.5 - 50) + (0 - 25)) / 2] * 3


def test_split_by_conversation_keeps_conversations_whole():
    recs = [TurnRecord(id=f"t{i}", context=[], user_turn="u", conversation_id=f"c{i // 3}") for i in range(300)]
    fit, held = split_by_conversation(recs, 0.25)
    assert len(fit) + len(held) == 300 and 30 < len(held) < 120
    assert not {r.conversation_id for r in fit} & {r.conversation_id for r in held}


def test_guided_config_checks():
    with pytest.raises(ConfigError, match="including 1"):
        GuidedConfig(ks=[4, 8])
    with pytest.raises(ConfigError, match="rules"):
        GuidedConfig(rules=["mode"])


def test_candidate_windows_of_a_shared_pool():
    assert [list(candidate_window(i, 3, 1, 16)) for i in range(3)] == [[0], [8], [15]]
    assert [list(candidate_window(i, 3, 4, 16)) for i in range(3)] == [[0, 1, 2, 3], [6, 7, 8, 9], [12, 13, 14, 15]]
    assert [candidate_window(i, 3, 8, 16)[0] for i in range(3)] == [0, 4, 8]
    assert all(list(candidate_window(i, 3, 16, 16)) == list(range(16)) for i in range(3))
    assert list(candidate_window(0, 1, 4, 16)) == [0, 1, 2, 3]


def _fitted_guide(k=3):
    from adversary.discriminator import Discriminator
    from adversary.guidance import Guide

    ctx = [{"role": "assistant", "content": "How can I help?"}]
    real = [TurnRecord(id=f"r{i}", context=ctx, user_turn=t) for i, t in enumerate(
        ["fix my code pls", "why does it crash", "make it shorter", "ok and in python?", "no, the other one",
         "thx. more examples", "wrong answer", "explain like im 5"] * 3)]
    sim = [TurnRecord(id=f"s{i}", context=ctx, user_turn=t) for i, t in enumerate(
        ["Certainly! I would be delighted to assist you with that request.", "Thank you so much for your help!",
         "Could you please elaborate further on the aforementioned topic?", "I appreciate your detailed response.",
         "Please provide a comprehensive overview.", "That is very helpful, thank you kindly.",
         "I would like to know more about this.", "Would you be so kind as to explain?"] * 3)]
    disc = Discriminator(None, classical=True, weights=(0.0, 1.0), seed=0).fit(real + sim, [1] * 24 + [0] * 24)
    return Guide(disc, (1.0, 0.0), k=k)


def test_guide_picks_the_real_looking_candidate_and_round_trips(tmp_path):
    from adversary.guidance import Guide

    guide = _fitted_guide()
    ctx = [{"role": "assistant", "content": "How can I help?"}]
    groups = [[TurnRecord(id="a", context=ctx, user_turn=t) for t in
               ("Certainly! Thank you so much for your kind help.", "fix it pls", "I appreciate it, thank you kindly.")]]
    z = guide.logodds(groups[0])
    assert z[1] > max(z[0], z[2])  # the terse turn looks real, the polite ones do not
    argmax = Guide(guide.disc, guide.platt, 3, "argmax")
    assert argmax.pick(groups, np.random.default_rng(0)).tolist() == [1]
    guide.save(tmp_path / "g")
    back = Guide.load(tmp_path / "g", k=5)
    assert back.k == 5 and back.rule == "resample"
    items = groups[0]
    assert np.allclose(back.logodds(items), guide.logodds(items))


def test_fit_guide_fits_on_some_conversations_and_calibrates_on_the_others():
    from adversary.config import AdversaryConfig
    from adversary.guidance import fit_guide

    ctx = [{"role": "assistant", "content": "How can I help?"}]
    terse = ["fix my code pls", "why does it crash", "make it shorter", "ok and in python?", "no, the other one",
             "thx. more examples", "wrong answer", "explain like im 5"]
    polite = ["Certainly! I would be delighted to assist you.", "Thank you so much for your help!",
              "Could you please elaborate further on the topic?", "I appreciate your detailed response.",
              "Please provide a comprehensive overview.", "That is very helpful, thank you kindly.",
              "I would like to know more about this.", "Would you be so kind as to explain?"]
    real = [TurnRecord(id=f"c{i}_t", context=ctx, user_turn=terse[i % 8] + f" {i}", conversation_id=f"c{i}")
            for i in range(80)]
    sims = [TurnRecord(id=r.id, context=ctx, user_turn=polite[i % 8], conversation_id=r.conversation_id)
            for i, r in enumerate(real)]
    from adversary.stages import make_discriminator

    guide = fit_guide(make_discriminator(AdversaryConfig(disc_weights=[0.0, 1.0]), 0), real, sims, 0.25, k=4)
    rep = guide.report
    fit, held = split_by_conversation(real, 0.25)
    assert (rep["fit_items"], rep["calibration_items"]) == (2 * len(fit), 2 * len(held))
    assert rep["members"] == ["classical"] and guide.k == 4 and guide.rule == "resample"
    assert rep["heldback"]["raw"]["accuracy"] == 1.0  # separable: every held-back pair told apart
    assert guide.platt[0] > 0  # the calibrated log-odds keep the raw ones' order
    groups = [[TurnRecord(id="x", context=ctx, user_turn=t) for t in (polite[0], "fix it pls", polite[3], polite[5])]]
    assert Guide(guide.disc, guide.platt, 4, "argmax").pick(groups, np.random.default_rng(0)).tolist() == [1]
    with pytest.raises(ValueError, match="more contexts"):
        fit_guide(make_discriminator(AdversaryConfig(disc_weights=[0.0, 1.0]), 0), real[:1], sims[:1])


def _guided_export(tmp_path, model_path, guide, max_new_tokens: int):
    """A frozen export of the tiny model that carries `guide` (its K and rule recorded in the manifest)."""
    from adversary.export import export_frozen
    from adversary.guidance import GUIDE_DIR
    from generator.model import load_generator

    model, tok = load_generator(model_path)
    out = tmp_path / "frozen"
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "top_p": 0.95, "top_k": 0, "min_new_tokens": 1,
                "max_prompt_tokens": 64}
    export_frozen(model, tok, out, {"sampling": sampling,
                                    "guidance": {"k": guide.k, "rule": guide.rule, "dir": GUIDE_DIR}},
                  extra=lambda d: guide.save(d / GUIDE_DIR))
    return out


def test_a_guided_export_is_hashed_and_load_simulator_uses_its_guide(tmp_path, tiny_lm_path):
    from adversary.export import verify_export
    from adversary.guidance import GUIDE_DIR
    from agent_rl.gyms import UserRequest
    from agent_rl.users import load_simulator

    out = _guided_export(tmp_path, tiny_lm_path, _fitted_guide(k=3), max_new_tokens=6)
    assert verify_export(out) == []
    assert any(name.startswith(f"{GUIDE_DIR}/") for name in __import__("json").loads(
        (out / "simulator.json").read_text())["files"])
    sim = load_simulator(f"frozen:{out}", dtype="fp32")
    assert sim.guide is not None and sim.guide.k == 3 and sim.spec.endswith("#guidance=3")
    reqs = [UserRequest(context=[{"role": "assistant", "content": "What do you need?"}], goal="book a table",
                        gym="travel", task=None)] * 2
    assert len(sim.reply(reqs)) == 2
    assert load_simulator(f"frozen:{out}#guidance=1", dtype="fp32").guide is None
    assert load_simulator(f"frozen:{out}#guidance=5", dtype="fp32").guide.k == 5
    (out / GUIDE_DIR / "guide.json").chmod(0o644)
    (out / GUIDE_DIR / "guide.json").write_text("{}")
    with pytest.raises(Exception, match="modified"):
        load_simulator(f"frozen:{out}", dtype="fp32")


def test_guidance_on_a_model_without_a_guide_is_refused(tiny_lm_path):
    from adversary.guidance import split_guidance
    from agent_rl.users import check_simulator_spec
    from conversations import DataError

    assert split_guidance("frozen:d#guidance=4#persona=x") == ("frozen:d#persona=x", 4)
    with pytest.raises(DataError, match="frozen export that carries a guide"):
        check_simulator_spec(f"hf:{tiny_lm_path}#guidance=4")
    with pytest.raises(DataError, match="candidate count"):
        split_guidance("frozen:d#guidance=zero")


def test_compare_samples_a_guided_export_through_its_guide_at_both_levels(tmp_path, tiny_lm_path):
    """adversary.compare's simulator for a guided export keeps, with the argmax rule, the candidate the guide scores
    highest (turn level), and writes conversations through the same guide; #guidance=1 samples unguided."""
    from adversary.compare import EngineSimulator, label
    from adversary.guidance import guided_records
    from generator.assistants import ReplayAssistant
    from generator.engine import SamplingSettings

    guide = _fitted_guide(k=3)
    guide.rule = "argmax"
    out = _guided_export(tmp_path, tiny_lm_path, guide, max_new_tokens=5)
    sim = EngineSimulator(f"frozen:{out}", "fp32", 8, SamplingSettings())
    assert sim.guide is not None and sim.guide.k == 3 and sim.guide.rule == "argmax"
    assert sim.settings.max_new_tokens == 5  # the export's own sampling
    ctx = [{"role": "assistant", "content": "How can I help?"}]
    recs = [TurnRecord(id=f"r{i}", context=ctx, user_turn="x", conversation_id=f"c{i}") for i in range(4)]
    kept, z, pick = guided_records(sim.engine, sim.guide, recs, sim.settings, seed=3)
    assert z.shape == (4, 3) and pick.tolist() == z.argmax(1).tolist()
    assert [r.meta["candidate"] for r in kept] == pick.tolist() and [r.id for r in kept] == [r.id for r in recs]
    assert [r.user_turn for r in sim.turns(recs, seed=3)] == [r.user_turn for r in kept]  # compare's turn level
    from conversations import Conversation

    real = [Conversation(id="c0", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes?"},
                                            {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}])]
    convs = sim.conversations(ReplayAssistant.from_conversations(real, start_user_turns=1),
                              [[{"role": "user", "content": "hi"}]], ["c0"], 2, seed=1)
    assert len(convs) == 1 and convs[0].user_turns >= 1
    assert EngineSimulator(f"frozen:{out}#guidance=1", "fp32", 8, SamplingSettings()).guide is None
    assert label(f"frozen:{out}#guidance=1").endswith("#guidance=1")


def test_the_meters_conversations_go_through_a_guide(tiny_lm_path):
    """The conversation level of a guided simulator (the study's guided arms): every simulated user turn is the one
    the guide kept of its K candidates, and the kept text is one of them; without a guide no candidate is weighed."""
    from types import SimpleNamespace

    from adversary.conversation_meter import simulate_heldout_conversations
    from conversations import Conversation
    from generator.engine import SamplingSettings
    from generator.model import load_generator

    model, tok = load_generator(tiny_lm_path)
    guide = _fitted_guide(k=3)
    seen = []  # every group of K candidates the guide weighed, with the one it kept
    weigh = guide.weigh

    def spy(groups, rng):
        z, pick = weigh(groups, rng)
        seen.extend((g, g[p].user_turn) for g, p in zip(groups, pick))
        return z, pick

    guide.weigh = spy
    real = [Conversation(id=f"c{i}", messages=[
        {"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yes?"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "bye"}]) for i in range(3)]
    cfg = SimpleNamespace(sim_batch_size=8, conv_max_turns=2)
    settings = SamplingSettings(max_new_tokens=6)
    convs = simulate_heldout_conversations(model, tok, real, cfg, settings, seed=1, precision="fp32", guide=guide)
    written = [m["content"] for c in convs for m in c.messages[1:] if m["role"] == "user"]
    assert len(written) == sum(c.user_turns for c in convs) == 6  # 3 conversations x 2 simulated turns
    assert len(seen) == len(written) and all(len(g) == 3 for g, _ in seen)
    assert sorted(written) == sorted(kept.strip() for _, kept in seen)
    seen.clear()
    simulate_heldout_conversations(model, tok, real, cfg, settings, seed=1, precision="fp32")
    assert seen == []


def test_the_meters_samples_per_context_come_from_one_call(varied_lm):
    """meter_seeds samples per held-out context drawn in one call: n lists aligned with the contexts, written as one
    sample each (no candidate index); greedy, every list is the one-sample meter's turn; sampled, the lists differ."""
    from types import SimpleNamespace

    from adversary.heldout import simulate_heldout, simulate_heldout_samples

    model, tok = varied_lm
    recs = [TurnRecord(id=f"r{i}", context=[{"role": "assistant", "content": f"what next {i}?"}], user_turn="x")
            for i in range(5)]
    cfg = SimpleNamespace(sim_batch_size=4, heldout_max_new_tokens=8, max_context_tokens=64, sim_temperature=0.0,
                          sim_top_p=1.0)
    greedy = simulate_heldout_samples(model, tok, recs, cfg, 2, seed=3, precision="fp32")
    one = simulate_heldout(model, tok, recs, cfg, seed=3, precision="fp32")
    assert len(greedy) == 2 and all([s.id for s in g] == [r.id for r in recs] for g in greedy)
    assert [s.user_turn for s in greedy[0]] == [s.user_turn for s in greedy[1]] == [s.user_turn for s in one]
    assert all(set(s.meta) == {"ended", "truncated"} for g in greedy for s in g)
    cfg.sim_temperature = 1.0
    sampled = simulate_heldout_samples(model, tok, recs, cfg, 2, seed=3, precision="fp32")
    assert [s.user_turn for s in sampled[0]] != [s.user_turn for s in sampled[1]]
    assert simulate_heldout_samples(model, tok, recs, cfg, 2, seed=3, precision="fp32")[1][0].user_turn == \
        sampled[1][0].user_turn  # the same seed, the same samples
    # one sample per context is what simulate_records samples: a one-sample meter reads as it always did
    from adversary.heldout import heldout_settings
    from generator.engine import Engine
    from generator.sample import simulate_records

    plain = simulate_records(Engine(model, tok, batch_size=4, precision="fp32"), recs, heldout_settings(cfg), seed=3)
    assert [(s.user_turn, s.meta) for s in simulate_heldout(model, tok, recs, cfg, seed=3, precision="fp32")] == \
        [(s.user_turn, s.meta) for s in plain]
