# Nix entry point of the Hub build: kernel-builder (huggingface/kernels) reads build.toml and builds
# every torch/CUDA variant into build/ with `nix run .#build-and-copy -L`. Commit the flake.lock
# that the first run writes, so builds pin kernel-builder and are not flagged dirty.
{
  description = "ltx_kernels: fused H100 kernels for diffusers transformers";

  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    { self, kernel-builder, ... }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}
