"""Reaching attributes through wrapper modules, and the ModelType enum."""

from __future__ import annotations

import pytest
import torch

from megatron.core import ModelParallelConfig
from megatron.core.enums import ModelType
from megatron.core.utils import get_attr_wrapped_model, get_model_config, get_model_type


class TinyModel(torch.nn.Module):
    def __init__(self, config: ModelParallelConfig):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.linear = torch.nn.Linear(2, 2)

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor


class Wrapper(torch.nn.Module):
    """Stands in for DDP / Float16Module: holds the real model in .module."""

    def __init__(self, module: torch.nn.Module, config=None):
        super().__init__()
        self.module = module
        self.config = config


@pytest.fixture
def config():
    return ModelParallelConfig()


def test_attribute_on_the_model_itself(config):
    model = TinyModel(config)
    assert get_attr_wrapped_model(model, "config") is config


def test_descends_through_nested_wrappers(config):
    inner = TinyModel(config)
    wrapped = Wrapper(Wrapper(inner))
    assert get_attr_wrapped_model(wrapped, "set_input_tensor") == inner.set_input_tensor
    assert get_attr_wrapped_model(wrapped, "linear", return_model_obj=True) is inner


def test_allow_none_decides_whether_a_none_attribute_counts(config):
    inner = TinyModel(config)
    wrapped = Wrapper(inner, config=None)
    assert get_attr_wrapped_model(wrapped, "config") is None
    assert get_attr_wrapped_model(wrapped, "config", allow_none=False) is config
    holder = get_attr_wrapped_model(wrapped, "config", allow_none=False, return_model_obj=True)
    assert holder is inner


def test_outermost_layer_wins(config):
    outer_config = ModelParallelConfig(tensor_model_parallel_size=2)
    wrapped = Wrapper(TinyModel(config), config=outer_config)
    assert get_model_config(wrapped) is outer_config


def test_missing_attribute_names_it_and_the_layers_searched(config):
    wrapped = Wrapper(TinyModel(config))
    with pytest.raises(RuntimeError) as excinfo:
        get_attr_wrapped_model(wrapped, "decoder")
    assert "'decoder'" in str(excinfo.value)
    assert "Wrapper -> TinyModel" in str(excinfo.value)


def test_attribute_that_is_none_everywhere_fails_without_allow_none():
    wrapped = Wrapper(Wrapper(torch.nn.Linear(2, 2), config=None), config=None)
    with pytest.raises(RuntimeError, match="non-None attribute 'config'"):
        get_model_config(wrapped)


def test_list_of_model_chunks_is_rejected(config):
    with pytest.raises(RuntimeError, match="list of 2"):
        get_attr_wrapped_model([TinyModel(config), TinyModel(config)], "config")


def test_get_model_config_and_type_through_a_wrapper(config):
    wrapped = Wrapper(TinyModel(config))
    assert get_model_config(wrapped) is config
    assert get_model_type(wrapped) is ModelType.encoder_or_decoder


def test_model_type_members_match_core_0_11():
    assert {member.name: member.value for member in ModelType} == {
        "encoder_or_decoder": 1,
        "encoder_and_decoder": 2,
        "retro_encoder": 3,
        "retro_decoder": 4,
    }
