"""One module per stage; each defines ``register(app)`` and adds its subcommands to the ``gemflow`` CLI.

Commands import their stage lazily (inside the function) so ``gemflow --help`` stays instant.
"""
