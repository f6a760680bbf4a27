"""Preparing a sharded state dict for ``save`` and ``load``: factories built, non-persistent
objects set aside, the sharded leaves parted from the common part."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    extract_matching_values,
)
from megatron.core.dist_checkpointing.mapping import (
    CommonStateDict,
    ShardedStateDict,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
)
from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base
from megatron.core.dist_checkpointing.validation import (
    determine_global_metadata,
    validate_sharding_integrity,
)


def save_preprocess(sharded_state_dict: ShardedStateDict, validate_access_integrity: bool = True,
                    preprocess_common_before_consistancy_check: Optional[
                        Callable[[CommonStateDict], StateDict]] = None
                    ) -> Tuple[ShardedStateDict, StateDict]:
    """(the sharded leaves, the common part) of ``sharded_state_dict``, whose factories are
    built in place; non-persistent objects are dropped. ``validate_access_integrity``: check
    the sharding (collective) and log where ranks' common parts differ, compared after
    ``preprocess_common_before_consistancy_check`` (which must not change its argument)."""
    apply_factories(sharded_state_dict)
    _, persistent = extract_nonpersistent(sharded_state_dict)
    sharded, common = extract_sharded_base(persistent)
    if validate_access_integrity:
        compared = common
        if preprocess_common_before_consistancy_check is not None:
            compared = preprocess_common_before_consistancy_check(common)
        validate_sharding_integrity(determine_global_metadata(sharded)[1], compared)
    return sharded, common


def load_preprocess(sharded_state_dict: ShardedStateDict
                    ) -> Tuple[ShardedStateDict, StateDict, ShardedStateDict]:
    """(a copy of the nesting with factories built, the non-persistent objects unwrapped, the
    factories without data for ``apply_factory_merges``); the argument is left as it was."""
    copied, _ = extract_matching_values(sharded_state_dict, lambda leaf: True)
    factories, _ = extract_matching_values(copied, lambda leaf: isinstance(
        leaf, ShardedTensorFactory), return_lists_as_dicts=True)
    apply_factories(copied)
    # The factories' tensors are not needed any more: keep no reference that pins them.
    dict_list_map_inplace(ShardedTensorFactory.without_data, factories)
    nonpersistent, copied = extract_nonpersistent(copied)
    dict_list_map_inplace(lambda obj: obj.unwrap(), nonpersistent)
    return copied, nonpersistent, factories
