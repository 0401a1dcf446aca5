"""The commands around serving that serving never needs: `fw bench`, `fw doctor`, `fw warm-cache`, `fw plugins
new` (scaffold), the flag reference and the plugin-API snapshot.

They import the inference core; the inference core never imports them (tests/test_import_graph.py). The `fw`
command line (fw.cli) loads each one only when it runs, so `fw --help` stays light."""
