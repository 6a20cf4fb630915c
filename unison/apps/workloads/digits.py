"""The UCI handwritten digits bundled with scikit-learn: nothing is downloaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset


@dataclass
class Digits:
    """The standardized train and test splits as tensors."""

    train: TensorDataset
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_data(seed: int, test_fraction: float) -> Digits:
    """Split the digits (stratified, seeded) and standardize with training statistics only,
    so the test set stays unseen."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_train)
    train = TensorDataset(features(scaler, x_train), torch.as_tensor(y_train, dtype=torch.long))
    return Digits(train, features(scaler, x_test), torch.as_tensor(y_test, dtype=torch.long))


def features(scaler, x) -> torch.Tensor:
    """``x`` standardized by ``scaler``, as float32 (the model's dtype)."""
    return torch.tensor(scaler.transform(x), dtype=torch.float32)
