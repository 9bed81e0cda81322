"""Programs from Debian that some tests drive (chromium, chromedriver, prometheus, promtool).

.ci/run installs them and sets DEEPINFER_REQUIRE_TOOLS=1: there a missing program fails the test.
Elsewhere the test skips and says which package to install.
"""
from __future__ import annotations

import os
import shutil

import pytest

PACKAGES = {"chromium": "chromium", "chromedriver": "chromium-driver", "prometheus": "prometheus",
            "promtool": "prometheus"}


def require_tool(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        message = f"{program} is not installed (apt-get install {PACKAGES[program]}; .ci/run does)"
        if os.environ.get("DEEPINFER_REQUIRE_TOOLS"):
            pytest.fail(message)
        pytest.skip(message)
    return path
