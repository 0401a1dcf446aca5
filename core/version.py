"""Version numbers: the distribution's, and the plugin API's that plugins target."""

__version__ = "0.1.0"

# MAJOR.MINOR. A plugin built for another MAJOR is refused; one built for a newer
# MINOR than this core loads with a warning (it may use hooks this core lacks).
PLUGIN_API_VERSION = "1.11"
