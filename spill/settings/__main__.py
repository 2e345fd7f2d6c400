"""``python -m spill.settings``: write the group sections of schemas/spill-yaml.schema.json."""

from spill.settings.schema import write_schema

write_schema()
