# tests/mpunix/build-frozen.sh builds this into the frozen Unix-port VM (USER_C_MODULES).
TLSALLOC_MOD_DIR := $(USERMOD_DIR)
SRC_USERMOD_C += $(TLSALLOC_MOD_DIR)/tlsalloc.c
