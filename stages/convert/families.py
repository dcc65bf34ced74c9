"""The converter's view of the model families: the specs live in the shared library `slimeflow.families`.

Re-exported here for code that imported the converter's names before the specs were shared.
"""

from slimeflow.families import (
    BY_ARCHITECTURE,
    FAMILIES,
    GLOBAL_RULES,
    VOCAB_PADDED,
    Rule,
    family_for,
    supported_architectures,
)
from slimeflow.families import FamilySpec as Family

__all__ = ["BY_ARCHITECTURE", "FAMILIES", "GLOBAL_RULES", "VOCAB_PADDED", "Family", "Rule", "family_for",
           "supported_architectures"]
