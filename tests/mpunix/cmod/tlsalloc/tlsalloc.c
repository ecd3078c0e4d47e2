// Where Mbed TLS allocates, chosen at run time in the frozen Unix-port VM
// (tests/mpunix/build-frozen.sh), so one binary measures both kinds of board:
//
//   import tlsalloc; tlsalloc.outside()   # before the first TLS object
//
// Default (as built, MICROPY_MBEDTLS_CONFIG_BARE_METAL): Mbed TLS allocates
// from the Python heap (m_tracked_calloc), as on a Pico W. outside() switches
// it to libc's calloc/free, i.e. outside -X heapsize, as on an ESP32, whose
// Mbed TLS allocates from the ESP-IDF heap next to (not inside) MicroPython's.
// It must run before anything TLS allocated: a block is freed by the
// allocator that made it.
#include <stdlib.h>
#include "py/runtime.h"

int mbedtls_platform_set_calloc_free(void *(*calloc_func)(size_t, size_t), void (*free_func)(void *));

static bool tls_outside = false;

static mp_obj_t tlsalloc_outside(void) {
    mbedtls_platform_set_calloc_free(calloc, free);
    tls_outside = true;
    return mp_const_none;
}
static MP_DEFINE_CONST_FUN_OBJ_0(tlsalloc_outside_obj, tlsalloc_outside);

static mp_obj_t tlsalloc_where(void) {
    return MP_OBJ_NEW_QSTR(tls_outside ? MP_QSTR_libc : MP_QSTR_heap);
}
static MP_DEFINE_CONST_FUN_OBJ_0(tlsalloc_where_obj, tlsalloc_where);

static const mp_rom_map_elem_t tlsalloc_globals_table[] = {
    { MP_ROM_QSTR(MP_QSTR___name__), MP_ROM_QSTR(MP_QSTR_tlsalloc) },
    { MP_ROM_QSTR(MP_QSTR_outside), MP_ROM_PTR(&tlsalloc_outside_obj) },
    { MP_ROM_QSTR(MP_QSTR_where), MP_ROM_PTR(&tlsalloc_where_obj) },
};
static MP_DEFINE_CONST_DICT(tlsalloc_globals, tlsalloc_globals_table);

const mp_obj_module_t tlsalloc_module = {
    .base = { &mp_type_module },
    .globals = (mp_obj_dict_t *)&tlsalloc_globals,
};

MP_REGISTER_MODULE(MP_QSTR_tlsalloc, tlsalloc_module);
