"""How a mixture of experts' router (layers.SparseMoE) turns its logits into each token's experts
and their weights, as transformers' routers do:
  * softmax over all experts, the top k, renormalized or not (Qwen3-MoE, Mixtral, OLMoE);
  * a softmax over the top k logits alone (gpt-oss);
  * DeepSeek's (a `Routing`): scores by softmax (V2) or sigmoid (V3); V3's selection bias
    (e_score_correction_bias) added to the scores only to choose, the chosen experts weighted
    by their unbiased scores; experts in `groups` equal groups, each token choosing among those
    of the `topk_groups` groups that score best (a group's score: the sum of its `group_top`
    best, V3 2, V2 1: its max); the chosen weights renormalized (V3's norm_topk_prob) and times
    `scale` (routed_scaling_factor).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Routing:
    """DeepSeek's routing options (the module docstring); DeepSeek's routers compute their logits
    in float32, as transformers keeps their weights."""
    sigmoid: bool = False
    selection_bias: bool = False
    groups: int = 1
    topk_groups: int = 1
    group_top: int = 1
    scale: float = 1.0


def route(logits, top_k: int, renormalize: bool, softmax_topk: bool = False, routing: Routing = Routing(),
          selection_bias=None):
    """(weights, experts) [T, top_k] float32 of router logits [T, E]; renormalize: the top-k
    weights divided by their sum; selection_bias: f32[E] when routing.selection_bias."""
    logits = logits.astype(jnp.float32)
    if softmax_topk:
        top, chosen = jax.lax.top_k(logits, top_k)
        return jax.nn.softmax(top, axis=-1), chosen
    scores = jax.nn.sigmoid(logits) if routing.sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores if selection_bias is None else scores + selection_bias.astype(jnp.float32)
    if routing.topk_groups < routing.groups:
        choice = _in_best_groups(choice, routing)
    _, chosen = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)   # transformers' epsilon (V3)
    return weights * routing.scale, chosen


def _in_best_groups(choice, routing: Routing):
    """choice [T, E] with the experts outside each token's topk_groups best groups at -inf."""
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, routing.groups, experts // routing.groups)
    group_scores = jax.lax.top_k(grouped, routing.group_top)[0].sum(axis=-1)   # [T, groups]
    _, best = jax.lax.top_k(group_scores, routing.topk_groups)
    keep = (best[..., None] == jnp.arange(routing.groups)).any(axis=-2)   # [T, groups]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(tokens, experts)
