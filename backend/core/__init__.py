"""The core of keyed state: key groups, table keys, change records, serializers, descriptors, handles, errors.

Plain definitions and byte layouts with no state of their own; every layer above imports them.
"""
