"""Built-in MoE kernels (plugin kind `moe_kernel`): how Mixture-of-Experts layers compute their experts."""
