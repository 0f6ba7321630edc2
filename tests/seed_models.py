"""The seeds' model (shared/seeds: "TestForHook"), with the weights the article sets to ones."""

from __future__ import annotations

from torch import nn


class TestForHook(nn.Module):
    """Two Linear layers and two activations with unit weights: input 0.1 gives linear_1 = 1.2, linear_2 = 3.4."""

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(2, 2)
        self.linear_2 = nn.Linear(2, 1)
        self.relu = nn.ReLU()
        self.relu6 = nn.ReLU6()
        for parameter in self.parameters():
            nn.init.ones_(parameter)

    def forward(self, x):
        linear_1 = self.linear_1(x)
        linear_2 = self.linear_2(linear_1)
        relu = self.relu(linear_2)
        relu6 = self.relu6(relu)
        return relu6, (x, linear_1, linear_2), (linear_2, relu, relu6)
