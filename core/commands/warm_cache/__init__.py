"""`fw warm-cache`: prepare ahead what serving needs (model files, built kernels, compiled steps, precompiled
grammars) and report each artifact as a hit or a miss.

The artifact contract plugins implement, and the ready-made artifacts, stay in fw.warm (the plugin API); this
package is the command that collects, checks and builds them."""
