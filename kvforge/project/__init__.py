"""The project's own files: target files (and the platforms they name), patch files and series, a
series directory on disk, the dropped-patch ledger. Writes to patches/ and targets/ go through this
package only.
"""
