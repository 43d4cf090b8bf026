"""distft: finetune Qwen3, Llama 3, Qwen2.5 and Mistral on meeting transcripts with every parallel strategy."""

import logging

__version__ = "0.1.0"

# transformers imports torchao (QLoRA's NF4, `distft.model.nf4`) whenever it is installed. On a CPU
# build of torch its CUDA extensions fail to load, and it registers enums the deprecated way: a
# warning each, in every process. NF4 is pure PyTorch and needs neither; errors still show. peft
# imports bitsandbytes (`optim.name=adamw-8bit`) whenever it is installed, which on a CPU with
# bf16 instructions warns of a 4-bit kernel package distft never uses.
for _name in ("torchao", "torch.utils._pytree", "bitsandbytes"):
    logging.getLogger(_name).setLevel(logging.ERROR)
# And offline, the kernels package (transformers' hub kernels) says on every command that it skips
# the publisher check of bitsandbytes' CPU 4-bit kernel, which distft never loads: that line alone.
logging.getLogger("kernels._internals.hf_hub").addFilter(
    lambda record: not record.getMessage().startswith("Skipping publisher trust check")
)

# Two more warnings on every command are silenced where they arise, by message, so any other
# warning from the same libraries still shows: DCP's single-process notice
# (`distft.io.checkpoint`) and peft's use of a deprecated transformers alias
# (`distft.model.build.peft_quietly`). transformers' bars for loading and writing local weights are
# quieted where distft first uses its models (`distft.model`): importing distft imports neither
# torch nor transformers, so that `distft --help` answers at once.
