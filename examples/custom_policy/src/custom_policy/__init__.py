"""An example trackside policy plugin: ``short_first`` (a batch policy) and ``least_tokens`` (a dispatch policy).

trackside finds them through the ``trackside.policies`` entry points in ``pyproject.toml``; nothing here imports
anything of trackside but its public policy API (``policies.base``, ``policies.types``, ``policies.params``).
"""

from custom_policy.batch import ShortFirst
from custom_policy.dispatch import LeastTokens

__all__ = ["LeastTokens", "ShortFirst"]
