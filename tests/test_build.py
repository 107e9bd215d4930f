"""Checks on the built extension itself."""

import shutil
import subprocess

import pytest

import pyorch._C


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) not installed")
def test_extension_links_shared_libstdcxx():
    # A static copy of libstdc++ inside _C.so (seen on a GPU image) crashes every error message
    # that formats a number: its locale is never initialized. None of its symbols may be defined.
    out = subprocess.run(["nm", "-D", "--defined-only", pyorch._C.__file__],
                         capture_output=True, text=True, check=True).stdout
    copies = [line for line in out.splitlines() if "_ZNSo9_M_insert" in line or "codecvt" in line]
    assert not copies, f"_C.so defines libstdc++ stream symbols: {copies[:3]}"


def test_error_message_with_numbers_raises():
    import torch

    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match=r"\[64\]"):
        torch.ops.pyorch.rms_norm(torch.empty_like(x), x, torch.randn(63), 1e-6)
    if torch.cuda.is_available():
        xc = x.cuda()
        with pytest.raises(RuntimeError, match=r"\[64\]"):
            torch.ops.pyorch.rms_norm(torch.empty_like(xc), xc, torch.randn(63, device="cuda"), 1e-6)
