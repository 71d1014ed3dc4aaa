"""The autograd formula shared by the compiled relational attention ops (`cpu`, `triton`).

A forward op `(query, key, values, q_rel, k_rel, mask, *options) -> (symbols, relations, lse)` and its backward op
`(grad_symbols, grad_relations, query, key, values, q_rel, k_rel, symbols, relations, lse, mask, *options) -> the
gradients of the five tensors`, where the options are the same non-tensor arguments (`causal, offset, scaling,
relation_scaling` for `cpu`; `causal, window, two_sided, scaling, relation_scaling` for `triton`): the backward
recomputes each block from the saved log-sum-exp (`lse` itself has no gradient).
"""

import torch


def relational_op_autograd(backward_op):
    """(setup_context, backward) for `torch.library.register_autograd` of a relational attention forward op."""

    def setup_context(ctx, inputs, output):
        query, key, values, q_rel, k_rel, mask, *options = inputs
        symbols, relations, lse = output
        ctx.save_for_backward(query, key, values, q_rel, k_rel, symbols, relations, lse, mask)
        ctx.options = tuple(options)
        ctx.mark_non_differentiable(lse)

    def backward(ctx, grad_symbols, grad_relations, _grad_lse):
        query, key, values, q_rel, k_rel, symbols, relations, lse, mask = ctx.saved_tensors
        grad_symbols = torch.zeros_like(symbols) if grad_symbols is None else grad_symbols
        grad_relations = torch.zeros_like(relations) if grad_relations is None else grad_relations
        grads = backward_op(grad_symbols, grad_relations, query, key, values, q_rel, k_rel, symbols, relations, lse,
                            mask, *ctx.options)
        return (*grads, None, *(None for _ in ctx.options))  # none for the mask and the options

    return setup_context, backward


__all__ = ["relational_op_autograd"]
