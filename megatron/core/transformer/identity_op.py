"""Modules that do nothing, for the slots of a layer spec that a model leaves out (e.g. the
norm before attention when the attention's first linear normalises its input itself)."""

from __future__ import annotations

import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input; any constructor and call arguments are accepted and ignored."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """Called, returns the identity *function*, for slots that hold a function-maker (such as
    a bias-dropout-add factory)."""

    def forward(self, *args, **kwargs):
        return super().forward
