#!/usr/bin/env python3
"""Where each run config key is read (``agora_devkit.config_reads``): every key and its readers."""

import sys

from agora_devkit.config_reads import main

if __name__ == "__main__":
    sys.exit(main())
