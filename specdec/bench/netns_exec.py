"""`python -m specdec.bench.netns_exec NAMESPACE MODULE ARGS...`: run `python -m MODULE ARGS...` inside
a network namespace (netdelay.NetnsNetwork). `ip netns exec` replaces this process, so the pid the
launcher holds is the service's own and its signals reach the service.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    namespace, module, *args = sys.argv[1:]
    os.execvp("ip", ["ip", "netns", "exec", namespace, sys.executable, "-m", module, *args])
