"""Test models, defined here so the tests need neither torchvision nor a download."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# --- ResNet-18 with torchvision's layout (same module names, same topology) -------------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 64):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(width, 2)
        self.layer2 = self._make_layer(width * 2, 2, stride=2)
        self.layer3 = self._make_layer(width * 4, 2, stride=2)
        self.layer4 = self._make_layer(width * 8, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# --- MobileNetV2-style: depthwise convs, ReLU6, inverted residuals ----------------------------
class ConvBNReLU6(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers: list[nn.Module] = [] if expand == 1 else [ConvBNReLU6(cin, hidden, 1)]
        layers += [
            ConvBNReLU6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2Small(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        cfg = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2), (6, 64, 1, 2)]
        layers: list[nn.Module] = [ConvBNReLU6(3, 32, 3, 2)]
        cin = 32
        for expand, cout, repeats, stride in cfg:
            for i in range(repeats):
                layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                cin = cout
        layers.append(ConvBNReLU6(cin, 128, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).mean((2, 3))
        return self.classifier(x)


# --- A small transformer encoder: embedding, multi-head attention, LayerNorm, GELU ------------
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // h)
        ctx = torch.matmul(scores.softmax(-1), v)
        return self.out(ctx.transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 32, heads: int = 4, layers: int = 2,
                 seq: int = 16, num_classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.layers = nn.Sequential(*[EncoderLayer(dim, heads, dim * 2) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.embed(tokens) + self.pos)
        return self.head(self.norm(x).mean(1))


# --- Two inputs, two outputs -----------------------------------------------------------------
class TwoInTwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.vec = nn.Linear(6, 8)
        self.head = nn.Linear(16, 4)

    def forward(self, image: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.relu(self.conv(image)).mean((2, 3))
        b = torch.relu(self.vec(features))
        emb = torch.cat([a, b], 1)
        return self.head(emb), emb


class _DenseLayer(nn.Module):
    """DenseNet's pre-activation layer: BN -> ReLU -> 1x1 conv -> BN -> ReLU -> 3x3 conv."""

    def __init__(self, channels: int, growth: int):
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(channels), nn.Conv2d(channels, 2 * growth, 1, bias=False)
        self.norm2, self.conv2 = nn.BatchNorm2d(2 * growth), nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(F.relu(self.norm1(x)))
        return torch.cat([x, self.conv2(F.relu(self.norm2(y)))], 1)


class PreActDenseNet(nn.Module):
    """A small DenseNet: its first batch norm in each layer reads a Concat, not a conv, so pt2e
    cannot fold it and the quantized model keeps it."""

    def __init__(self, num_classes: int = 10, growth: int = 8, layers: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False)
        self.layers = nn.Sequential(*(_DenseLayer(16 + i * growth, growth) for i in range(layers)))
        channels = 16 + layers * growth
        self.norm, self.head = nn.BatchNorm2d(channels), nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.layers(self.stem(x))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def with_statistics(model: nn.Module, shape: tuple[int, ...], seed: int = 0) -> nn.Module:
    """``model`` in eval mode with batch-norm statistics measured on random batches of ``shape``
    (the initial ones, mean 0 and variance 1, would make every norm near an identity)."""
    generator = torch.Generator().manual_seed(seed)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.momentum = None  # a cumulative average over the batches below
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(*shape, generator=generator))
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum  # as it was (a cumulative average is data-dependent control flow for QAT)
    return model.eval()


# --- A tiny classifier and a synthetic data set it learns in seconds --------------------------
def synthetic_images(n: int, seed: int = 0, size: int = 16, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Procedural 3×size×size images of ``classes`` patterns (stripes, checks, blobs) plus noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    freq = 1 + torch.rand(n, 1, 1, generator=g) * 0.5
    phase = torch.rand(n, 1, 1, generator=g) * 6.28
    patterns = torch.stack([
        torch.sin(yy * freq + phase),
        torch.sin(xx * freq + phase),
        torch.sin(xx * freq + phase) * torch.sin(yy * freq + phase),
        torch.exp(-((xx - size / 2) ** 2 + (yy - size / 2) ** 2) / (size * freq)) * 2 - 0.5,
    ], 1)[:, :classes]
    img = patterns[torch.arange(n), labels]
    colour = 0.5 + torch.rand(n, 3, 1, 1, generator=g)
    x = img.unsqueeze(1) * colour + 0.3 * torch.randn(n, 3, size, size, generator=g)
    return x.float(), labels


class TinyClassifier(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(32)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)) + x)
        return self.fc(torch.flatten(self.pool(x), 1))


def train_tiny_classifier(steps: int = 150, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Train :class:`TinyClassifier` on synthetic data; return it (eval mode) and a held-out set."""
    torch.manual_seed(seed)
    x, y = synthetic_images(2048, seed=seed)
    model = TinyClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        idx = torch.randint(0, len(x), (64,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, synthetic_images(512, seed=seed + 1)
