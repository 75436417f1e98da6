"""agent_rl.micro_batches: the GRPO loss's micro-batches regrouped by length and cut, with the same gradient."""

import pytest

torch = pytest.importorskip("torch")

from agent_rl.micro_batches import by_length, by_prefix, common_prefix, padded_tokens, shared_prefix_logps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(prompt_lens, completion_lens, vocab=50, seed=0):
    """A TRL-shaped generation batch: prompts left-padded to the longest, completions right-padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    P, T, B = max(prompt_lens), max(completion_lens), len(prompt_lens)
    prompt_ids, prompt_mask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
    completion_ids, completion_mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for i, (p, t) in enumerate(zip(prompt_lens, completion_lens)):
        prompt_ids[i, P - p:] = torch.randint(1, vocab, (p,), generator=g)
        prompt_mask[i, P - p:] = 1
        completion_ids[i, :t] = torch.randint(1, vocab, (t,), generator=g)
        completion_mask[i, :t] = 1
    tool_mask = completion_mask * (torch.rand(B, T, generator=g) > 0.3)  # the user's tokens: never trained on
    advantages = torch.randn(B, T, generator=g) * completion_mask  # (B, T): turn credits times the group advantage
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "tool_mask": tool_mask, "advantages": advantages,
            "num_items_in_batch": tool_mask.sum(), "old_per_token_logps": None, "names": [f"ep{i}" for i in range(B)]}


def _split(batch, n):
    size = len(batch["prompt_ids"]) // n
    return [{k: (v if v is None or (torch.is_tensor(v) and v.ndim == 0) else v[i * size:(i + 1) * size])
             for k, v in batch.items()} for i in range(n)]


def test_by_length_groups_longest_first_and_cuts_each_to_its_columns():
    prompt_lens, completion_lens = [3, 5, 2, 4, 5, 3, 2, 4], [10, 2, 30, 7, 4, 25, 3, 12]
    chunks = _split(_batch(prompt_lens, completion_lens), 4)
    out = by_length(chunks)
    # episode lengths 13 7 32 11 9 28 5 16 -> longest first: (ep2, ep5), (ep7, ep0), (ep3, ep4), (ep1, ep6)
    assert [c["names"] for c in out] == [["ep2", "ep5"], ["ep7", "ep0"], ["ep3", "ep4"], ["ep1", "ep6"]]
    assert [tuple(c["prompt_ids"].shape) for c in out] == [(2, 3), (2, 4), (2, 5), (2, 5)]
    assert [c["completion_ids"].shape[1] for c in out] == [30, 12, 7, 3]
    for c in out:  # every completion-aligned tensor cut with the ids; the shared scalar and None kept
        assert c["tool_mask"].shape == c["advantages"].shape == c["completion_mask"].shape
        assert c["num_items_in_batch"] is chunks[0]["num_items_in_batch"] and c["old_per_token_logps"] is None
    assert padded_tokens(out)[1] == padded_tokens(chunks)[1] == sum(prompt_lens) + sum(completion_lens)
    assert padded_tokens(chunks)[0] == 8 * (5 + 30) and padded_tokens(out)[0] == 2 * (3 + 30 + 4 + 12 + 5 + 7 + 5 + 3)
    # every episode's real tokens are there, unchanged
    full = _batch(prompt_lens, completion_lens)
    for c in out:
        for row, name in enumerate(c["names"]):
            i = int(name[2:])
            real = full["completion_mask"][i].bool()
            assert torch.equal(c["completion_ids"][row][: int(real.sum())], full["completion_ids"][i][real])
            assert torch.equal(c["advantages"][row][: int(real.sum())], full["advantages"][i][real])
            p = full["prompt_mask"][i].bool()
            assert torch.equal(c["prompt_ids"][row][c["prompt_mask"][row].bool()], full["prompt_ids"][i][p])


def _loss(model, chunks):
    """TRL's dapo loss over these micro-batches (summed over tokens, normalised by the generation batch's count),
    accumulated as the trainer does: the policy-gradient term at ratio 1, -A * logp."""
    total = 0.0
    for c in chunks:
        ids = torch.cat([c["prompt_ids"], c["completion_ids"]], 1)
        mask = torch.cat([c["prompt_mask"], c["completion_mask"]], 1)
        T = c["completion_ids"].shape[1]
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -T - 1:-1]  # (B, T, V)
        logp = logits.log_softmax(-1).gather(-1, c["completion_ids"].unsqueeze(-1)).squeeze(-1)  # (B, T)
        total = total + (-c["advantages"] * logp * c["tool_mask"]).sum() / c["num_items_in_batch"]
    return total


def test_by_length_gives_the_same_loss_and_gradient(varied_lm):
    model, tok = varied_lm
    model = model.float().train()
    batch = _batch([4, 9, 2, 6], [12, 3, 20, 7], vocab=len(tok) - 1, seed=1)
    grads = []
    for chunks in (_split(batch, 2), by_length(_split(batch, 2))):
        model.zero_grad()
        loss = _loss(model, chunks)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    assert torch.allclose(l0, l1, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(g0, g1))
    assert any(a.abs().sum() > 0 for a in g0)


def test_by_prefix_puts_one_prompts_episodes_together_longest_first():
    batch = _batch([3, 3, 3, 3], [4, 9, 2, 6], seed=2)
    batch["prompt_ids"][2:] = batch["prompt_ids"][0]  # episodes 0, 2, 3 share a prompt; 1 has its own
    batch["prompt_ids"][1, -1] = 1 + batch["prompt_ids"][0, -1] % 40
    out = by_prefix(_split(batch, 2))
    shared_first = batch["prompt_ids"][0].tolist() < batch["prompt_ids"][1].tolist()
    expected = [["ep3", "ep0"], ["ep2", "ep1"]] if shared_first else [["ep1", "ep3"], ["ep0", "ep2"]]
    assert [c["names"] for c in out] == expected
    assert padded_tokens(out)[1] == padded_tokens(_split(batch, 2))[1]


def _fused_lora_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, initializer_range=0.5, tie_word_embeddings=True, pad_token_id=0)
    base = LlamaForCausalLM(cfg)
    add_fused_lm_head(base, outputs=("log_probs", "entropy"))  # as GRPOTrainer patches the policy
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, lora).train()


def test_shared_prefix_gives_trls_logps_entropies_and_gradient():
    model = _fused_lora_model()
    # three episodes of one task: a shared 20-token system prompt, first observations of 2-4 tokens, then turns
    batch = _batch([22, 24, 23], [9, 14, 5], vocab=63, seed=3)
    P, system = batch["prompt_ids"].shape[1], torch.arange(1, 21)
    for b, p in enumerate((22, 24, 23)):  # left-padded: row b's prompt starts at P - p
        batch["prompt_ids"][b, P - p:P - p + 20] = system
    batch["prompt_ids"][1, P - 24 + 2] = 63  # row 1 leaves the system prompt after 2 tokens
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    T = batch["completion_ids"].shape[1]
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-T] = -100
    results = []
    for shared in (False, True):
        model.zero_grad()
        if shared:
            logps, entropies, spared = shared_prefix_logps(model, ids, mask, T, compute_entropy=True, min_shared=2)
            assert spared == 2 * 2  # rows 0 and 2 share 20 tokens, row 1 only 2: the prefix is the 2
        else:
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            logps, entropies = out.log_probs[:, -T:], out.entropy[:, -T:]
        (-batch["advantages"] * logps * batch["tool_mask"]).sum().backward()
        results.append((logps.detach() * batch["completion_mask"], entropies.detach() * batch["completion_mask"],
                        [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    (lp0, en0, g0), (lp1, en1, g1) = results
    assert torch.allclose(lp0, lp1, atol=1e-5) and torch.allclose(en0, en1, atol=1e-5)
    # fp32 sums in another order: within 1e-5 of each gradient's largest entry (gradients here reach ~35)
    assert all((a - b).abs().max() <= 1e-5 * a.abs().max() for a, b in zip(g0, g1))
    assert all(a.abs().sum() > 0 for a in g0)  # every LoRA weight has a gradient, the prefix's included


def test_shared_prefix_declines_rows_that_share_too_little():
    model = _fused_lora_model()
    batch = _batch([5, 6], [4, 3], vocab=63, seed=4)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    assert shared_prefix_logps(model, ids, mask, 4) is None
    assert common_prefix([torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]), torch.tensor([1, 2])]) == 2


def test_shared_prefix_declines_a_model_that_recomputes_its_layers():
    """Activation checkpointing drops the cache inside the layers: the rows would not see the prefix."""
    model = _fused_lora_model()
    batch = _batch([20, 20], [4, 3], vocab=63, seed=5)
    batch["prompt_ids"][1] = batch["prompt_ids"][0]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    assert shared_prefix_logps(model, ids, mask, 4) is not None
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert shared_prefix_logps(model, ids, mask, 4) is None
    with torch.no_grad():  # no backward, no recompute: the cache is kept
        assert shared_prefix_logps(model, ids, mask, 4) is not None
