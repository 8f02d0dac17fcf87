"""The application layer: the `moe-rl` commands, run directory, checkpoints and reports.

Importing it drops the dependencies' named noise lines (moe_rl/app/console.py) before DeepSpeed
and Ray are imported, since DeepSpeed speaks at import time — on `moe-rl --help` too. `-v` /
`--verbose` on the command line keeps everything, import-time lines included.
"""
import sys

from moe_rl.app import console

if not {"-v", "--verbose"} & set(sys.argv[1:]):
    console.quiet()
