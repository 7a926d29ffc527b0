"""PyTorch's own MNIST example network (pytorch/examples, mnist/main.py: two convolutions,
dropout, two linear layers), unchanged, trained by mpips. Named from
jobs/torch_fashion_mnist.toml as ``model.kind = "torch_mnist:build"``."""

import torch
import torch.nn.functional as F
from torch import nn

import mpips.torch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def build(data):
    """The network on 28x28 grey images (the data's rows of 784 pixels, viewed as images)."""
    return mpips.torch.Model(Net(), F.nll_loss, input_shape=(1, 28, 28))
