"""The history store: the Redis layout and codecs, the Lua scripts, the Redis driver and the store's API."""
