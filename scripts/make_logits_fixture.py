#!/usr/bin/env python3
"""Reference logits from Hugging Face transformers for tests/torch/test_llama.cpp.

Run on a machine with torch, transformers, h5py and numpy (the GPU machine has them; the
computation itself is fp32 on the CPU, so the result is deterministic and does not depend on
the GPU):

    python3 scripts/make_logits_fixture.py models/kvs-tiny-a \
        --out tests/fixtures/kvs_tiny_a_logits.h5

Writes, for a byte-level model (token id = byte value, BOS prepended):
  tokens            int32 [201]       BOS + the first 200 bytes of TEXT
  logits            float32 [201, V]  logits at every position
  long_tokens       int32 [1000]      BOS + the first 999 bytes of TEXT
  long_last_logits  float32 [V]       logits of the last position of long_tokens
and root attributes naming the versions, dtype and attention implementation used.
The C++ test runs its own runner on the same tokens (the long case in chunks) and compares.
"""

import argparse
import json
import os
import sys

import h5py
import numpy as np
import torch
import transformers
from transformers import LlamaForCausalLM

# Fixed input text, in the style of the Debian documentation the model was trained on. Plain
# ASCII so that bytes and characters coincide. Do not edit: the fixture depends on it.
TEXT = (
    "Managing kernel modules\n"
    "=======================\n"
    "\n"
    "The kernel can load drivers for hardware and file systems on demand. A module is an\n"
    "object file that extends the running kernel without a reboot; it is installed below\n"
    "``/lib/modules/<version>/`` and is described by the files that ``depmod`` generates\n"
    "there. To list the modules that are currently loaded, run ``lsmod``, which reads\n"
    "``/proc/modules`` and prints the size of each module and the modules that use it.\n"
    "\n"
    "To load a module together with its dependencies, use ``modprobe`` rather than\n"
    "``insmod``: ``modprobe`` consults ``modules.dep`` and inserts the required modules\n"
    "first. Options for a module can be given on the command line or, persistently, in a\n"
    "file below ``/etc/modprobe.d/``, for example::\n"
    "\n"
    "    options snd-hda-intel power_save=1\n"
    "\n"
    "A module that must never be loaded automatically can be blacklisted in the same\n"
    "directory. Note that a blacklisted module can still be loaded explicitly, and that a\n"
    "module built into the kernel image cannot be unloaded at all. If the initial ramdisk\n"
    "contains a copy of the module, run ``update-initramfs -u`` after changing its options,\n"
    "otherwise the old settings are used during early boot.\n"
    "\n"
    "The ``sysfs`` file system exposes the parameters of every loaded module below\n"
    "``/sys/module/<name>/parameters/``. Parameters that are writable can be changed at run\n"
    "time by writing a new value to the corresponding file; this is useful for debugging, but\n"
    "such changes are lost when the module is removed or the system is restarted.\n"
)

SHORT_BYTES = 200
LONG_TOKENS = 1000


def write(path, tokens, logits, long_tokens, long_last, cfg, model_dir):
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.asarray(tokens, dtype=np.int32))
        f.create_dataset("logits", data=logits.astype(np.float32))
        f.create_dataset("long_tokens", data=np.asarray(long_tokens, dtype=np.int32))
        f.create_dataset("long_last_logits", data=long_last.astype(np.float32))
        f.attrs["transformers_version"] = str(transformers.__version__)
        f.attrs["torch_version"] = str(torch.__version__)  # a str subclass h5py refuses
        f.attrs["dtype"] = "float32"
        f.attrs["device"] = "cpu"
        f.attrs["attn_implementation"] = "eager"
        f.attrs["model"] = os.path.basename(os.path.normpath(model_dir))
        f.attrs["model_config"] = json.dumps(cfg.to_dict(), sort_keys=True, default=str)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="Hugging Face model folder (config.json + safetensors)")
    ap.add_argument("--out", default="tests/fixtures/kvs_tiny_a_logits.h5")
    args = ap.parse_args()

    data = TEXT.encode("ascii")
    if len(data) < LONG_TOKENS - 1:
        sys.exit(f"TEXT has {len(data)} bytes, the long case needs {LONG_TOKENS - 1}")

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    # "dtype" is the transformers >= 4.56 spelling; older versions only know torch_dtype.
    try:
        model = LlamaForCausalLM.from_pretrained(
            args.model, dtype=torch.float32, attn_implementation="eager")
    except TypeError:
        model = LlamaForCausalLM.from_pretrained(
            args.model, torch_dtype=torch.float32, attn_implementation="eager")
    model = model.to("cpu").eval()
    cfg = model.config
    if cfg.vocab_size != 256:
        sys.exit(f"{args.model}: vocab_size {cfg.vocab_size}; this fixture is for byte-level models")
    bos = cfg.bos_token_id

    def run(ids):
        with torch.no_grad():
            out = model(torch.tensor([ids], dtype=torch.long), use_cache=False)
        return out.logits[0].to(torch.float32).numpy()

    tokens = [bos] + list(data[:SHORT_BYTES])
    long_tokens = [bos] + list(data[:LONG_TOKENS - 1])
    logits = run(tokens)
    long_last = run(long_tokens)[-1]

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    try:
        write(tmp, tokens, logits, long_tokens, long_last, cfg, args.model)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, args.out)  # never leave a partial file at the final name

    pred = logits.argmax(-1)
    nll = -torch.log_softmax(torch.from_numpy(logits[:-1]), -1).gather(
        1, torch.tensor(tokens[1:]).unsqueeze(1)).mean().item()
    print(f"wrote {args.out}: {len(tokens)} tokens, logit scale {np.abs(logits).max():.3f}, "
          f"bits/byte {nll / np.log(2):.4f}, first argmaxes {pred[:8].tolist()}, "
          f"transformers {transformers.__version__}, torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
