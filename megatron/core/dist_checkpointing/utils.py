"""Splitting sharded state dicts by kind of leaf, and renaming their checkpoint keys."""

from __future__ import annotations

from typing import Dict, Tuple

from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    extract_matching_values,
)
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject, ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor,
    ShardedTensorFactory, StateDict,
)


def zip_strict(*iterables):
    """``zip`` that first checks every iterable has the same length (and says which)."""
    lists = [list(iterable) for iterable in iterables]
    lengths = [len(items) for items in lists]
    if len(set(lengths)) > 1:
        raise ValueError(f"zip_strict: iterables of unequal lengths {lengths}")
    return zip(*lists)


def _split(sharded_state_dict: ShardedStateDict, kinds) -> Tuple[ShardedStateDict, StateDict]:
    return extract_matching_values(sharded_state_dict, lambda leaf: isinstance(leaf, kinds))


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict
                            ) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors, everything else), each keeping the nesting."""
    return _split(sharded_state_dict, ShardedTensor)


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict
                                          ) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors and factories, everything else)."""
    return _split(sharded_state_dict, (ShardedTensor, ShardedTensorFactory))


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict
                                             ) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensors, factories and LocalNonpersistentObjects, everything else)."""
    return _split(sharded_state_dict,
                  (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject))


def extract_sharded_base(sharded_state_dict: ShardedStateDict
                         ) -> Tuple[ShardedStateDict, StateDict]:
    """(every sharded leaf, the common part)."""
    return _split(sharded_state_dict, ShardedBase)


def extract_nonpersistent(sharded_state_dict: ShardedStateDict
                          ) -> Tuple[ShardedStateDict, StateDict]:
    """(the LocalNonpersistentObjects, everything else)."""
    return _split(sharded_state_dict, LocalNonpersistentObject)


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Put ``prefix`` before the key of every sharded leaf, in place."""
    def add(leaf):
        if isinstance(leaf, ShardedBase):
            leaf.key = prefix + leaf.key
        return leaf

    dict_list_map_inplace(add, sharded_state_dict)


_RENAMED = (ShardedTensor, ShardedTensorFactory, ShardedObject)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str,
                                new_prefix: str) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in every key, in place; every key must start
    with ``old_prefix``."""
    def rename(leaf):
        if isinstance(leaf, _RENAMED):
            if not leaf.key.startswith(old_prefix):
                raise ValueError(f"key {leaf.key!r} does not start with {old_prefix!r}")
            leaf.key = new_prefix + leaf.key[len(old_prefix):]
        return leaf

    dict_list_map_inplace(rename, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict,
                         prefix_map: Dict[str, str]) -> None:
    """Rename each key by the first ``old -> new`` prefix of ``prefix_map`` it starts with
    (keys that start with none stay), in place."""
    def rename(leaf):
        if isinstance(leaf, _RENAMED):
            for old, new in prefix_map.items():
                if leaf.key.startswith(old):
                    leaf.key = new + leaf.key[len(old):]
                    break
        return leaf

    dict_list_map_inplace(rename, sharded_state_dict)
