"""What `import dat_hf` installs into the model files' hook points (`dat_hf/kernels/`: the compiled backends and ops,
the whole-step decoding ops, the concatenated and tensor-parallel projections, the MLP's recomputed activation) only
makes the model faster: with every one of them set aside, as a saved folder's remote code runs without dat_hf, a model
computes the same logits, gradients and generated scores (over masks attended block by block, which the model files
do themselves)."""

import pytest
import torch
from conftest import set_fast_paths_aside, tiny_config

import dat_hf.masking_dat as masking_dat
from dat_hf import DATForCausalLM
from dat_hf.masking_dat import build_masks

CASES = {
    # a window over more receivers than a block: a `WindowMask` attended block by block, in training
    "sliding-window": dict(relational_bias="sliding_window", sliding_window_size=4),
    # local blocks on the sensory heads: receiver blocks from the dense mask
    "sparse": dict(relational_bias="sparse", sparse_block_size=8, relational_heads_bias="causal"),
    "causal": {},
}


def run(model, ids, attention_mask):
    """Logits and parameter gradients of a training forward, and greedy decoding's tokens and scores."""
    model.train().zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=attention_mask)
    out.logits.logsumexp(-1).mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.eval()
    generated = model.generate(ids, attention_mask=attention_mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                               pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.logits.detach(), grads, generated.sequences, torch.stack(generated.scores)


@pytest.mark.parametrize("case", sorted(CASES))
def test_remote_code_alone_computes_what_the_fast_paths_compute(monkeypatch, case):
    monkeypatch.setattr(masking_dat, "RECEIVER_BLOCK", 8)  # (blocks over a short input)
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(initializer_range=0.2, max_position_embeddings=128, **CASES[case]))
    ids = torch.randint(1, 97, (2, 40))
    attention_mask = torch.ones_like(ids).index_fill_(1, torch.arange(3), 0)
    attention_mask[1] = 1
    if case != "causal":  # (the installed paths do take part)
        masks = build_masks([model.config.relational_bias], model.config, torch.zeros(2, 40, 32), attention_mask)
        assert next(iter(masks.values())).receiver_blocks is not None
    fast = run(model, ids, attention_mask)
    with monkeypatch.context() as remote:
        set_fast_paths_aside(remote)  # every replaceable's kernels, the compiled relational backends
        masks = build_masks([model.config.relational_bias], model.config, torch.zeros(2, 40, 32), attention_mask)
        # (receiver blocks are the model files' own: remote code attends block by block too)
        assert (next(iter(masks.values())).receiver_blocks is not None) == (case != "causal")
        alone = run(model, ids, attention_mask)
    assert torch.allclose(fast[0], alone[0], atol=1e-5)
    assert len(fast[1]) == len(alone[1]) and all(torch.allclose(f, a, atol=1e-5) for f, a in zip(fast[1], alone[1]))
    assert torch.equal(fast[2], alone[2])
    assert torch.allclose(fast[3], alone[3], atol=1e-4)
