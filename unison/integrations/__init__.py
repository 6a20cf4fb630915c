"""Entry points for other frameworks. Each lives in its own module and imports its
framework only when that module is imported, so ``import unison`` never does:

* ``unison.integrations.lightning.UnisonStrategy``: every unison algorithm behind
  PyTorch Lightning's ``Trainer(strategy=...)`` (``pip install "unison[lightning]"``).
* ``unison.integrations.huggingface``: ``UnisonTrainer`` (``transformers.Trainer``) and
  ``UnisonAccelerator`` (``accelerate.Accelerator``) (``pip install "unison[hf]"``).
"""
