"""The scheduler service: aiohttp app (``app.create_app``), config, and runtime builder.

Import :mod:`tangram.service.app` explicitly: this package stays import-light.
"""
