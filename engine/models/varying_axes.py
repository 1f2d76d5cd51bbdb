"""How shard_map's varying-axes check (check_vma) types a value, and casts that widen it.

Inside shard_map every value is typed as varying over some mesh axes (it may differ between the
devices along them) and invariant over the rest. jnp operations cast their operands to a common
type themselves; a custom gradient or kernel must do it by hand, and return gradients typed like
its inputs. The transpose of a cast to varying is a psum: it sums the partial gradients of an
operand that does not vary over an axis.
"""

from __future__ import annotations

import jax


def varying(x) -> frozenset:
  """The mesh axes over which x is typed as varying (none outside shard_map)."""
  manual = getattr(jax.typeof(x), 'manual_axis_type', None)
  return frozenset(manual.varying) if manual is not None else frozenset()


def vary(x, axes):
  """x typed as varying over `axes` too."""
  missing = tuple(sorted(a for a in axes if a not in varying(x)))
  return jax.lax.pcast(x, missing, to='varying') if missing else x


def vary_alike(*arrays) -> list:
  """The arrays typed as varying over every axis any of them varies over."""
  axes = frozenset().union(*(varying(a) for a in arrays))
  return [vary(a, axes) for a in arrays]
