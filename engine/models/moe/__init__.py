"""A mixture of experts in place of a block's MLP (the Llama family's `model.num_experts > 0`).

  layer.py            MoeMlp, MoeConfig: the router, top-k, the experts, the auxiliary losses
  config.py           its keys (model.num_experts, model.moe_*) and their checks (no JAX)
  dispatch.py         moving token-assignments to their experts and back on one device:
                      dropless (a grouped matmul) or with a capacity per expert
  tiled_ragged_dot.py the dropless grouped matmul on CPU: only the groups' rows, tile by tile
  balance.py          auxiliary-loss-free balancing: the router bias and its update from the load

How a layout splits the experts over devices is engine/parallel/'s (expert_exchange.py). This
package's own import stays free of JAX (the config schema reads config.py without it).
"""
