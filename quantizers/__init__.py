"""Built-in quantization-method plugins (fp8, gptq, awq, bitsandbytes, gguf) live here.

The unquantized reference method is part of the core (`fw.layers.UnquantizedLinearMethod`);
see docs/choices.md."""
