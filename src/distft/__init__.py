"""distft: finetune Qwen3, Llama 3, Qwen2.5 and Mistral on meeting transcripts with every parallel strategy."""

import logging

__version__ = "0.1.0"

# transformers imports torchao (QLoRA's NF4, `distft.model.nf4`) whenever it is installed. On a CPU
# build of torch its CUDA extensions fail to load, and it registers enums the deprecated way: a
# warning each, in every process. NF4 is pure PyTorch and needs neither; errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

# Two more warnings on every command are silenced where they arise, by message, so any other
# warning from the same libraries still shows: DCP's single-process notice
# (`distft.io.checkpoint`) and peft's use of a deprecated transformers alias
# (`distft.model.build.peft_quietly`).


def _quiet_transformers_bars(factory, args, kwargs):
    """transformers' per-call bars for loading and writing local weights finish in well under a
    second here and print a line each; hub downloads (huggingface_hub's own bars) keep theirs."""
    if kwargs.get("desc") in ("Loading weights", "Writing model shards"):
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


# transformers' own switch for its bars (importing its logging module only: ~0.5 s, no torch).
from transformers.utils import logging as _transformers_logging  # noqa: E402

if hasattr(_transformers_logging, "set_tqdm_hook"):  # transformers 5; older ones keep their bars
    _transformers_logging.set_tqdm_hook(_quiet_transformers_bars)
