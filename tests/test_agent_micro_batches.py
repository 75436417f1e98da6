"""agent_rl.micro_batches: the GRPO loss's micro-batches regrouped by length and cut, with the same gradient."""

import pytest

torch = pytest.importorskip("torch")

from agent_rl.micro_batches import by_length, padded_tokens  # noqa: E402

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
