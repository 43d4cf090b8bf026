"""distft: finetune Qwen3 on meeting transcripts with every parallel strategy."""

import logging

__version__ = "0.1.0"

# transformers imports torchao (QLoRA's NF4, `distft.model.nf4`) whenever it is installed. On a CPU
# build of torch its CUDA extensions fail to load, and it registers enums the deprecated way: a
# warning each, in every process. NF4 is pure PyTorch and needs neither; errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
