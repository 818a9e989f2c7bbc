"""The row kernels' launch shapes (cuda/row_config.h: choose_rows) are valid for every
kernel configuration the handlers accept and every row length: row_config_check.cc,
built with the host C++ compiler and run (no GPU needed)."""


def test_every_kernel_configuration_gives_a_valid_launch(host_check):
    assert "0 failures" in host_check("row_config_check")
